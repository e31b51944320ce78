"""Why an attempt failed, in words: the root cause a rank recorded (torchelastic's error file),
else the first rank traceback, else the launcher's log, read past where the logs ended when the
attempt started; and what a launcher killed by a signal means, which no log says.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from workbench.runs.node import NodeRole
from workbench.runs.rundir import RunDir


def error_file(rd: RunDir, role: NodeRole) -> Path:
    """Where torchrun copies the first failing rank's error (TORCHELASTIC_ERROR_FILE); emptied
    before each start, so what it holds is this attempt's root cause."""
    return rd.logs_dir / f"rank-error-node{role.node_rank}.json"


def log_sizes(rd: RunDir) -> dict[str, int]:
    """Where each log ends now: an attempt's errors are read after these offsets only."""
    return {p.name: p.stat().st_size for p in rd.log_files() if p.is_file()}


def _root_cause(path: Path, texts: dict[str, str], max_lines: int) -> str | None:
    try:
        message = json.loads(path.read_text(encoding="utf-8"))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(message, str):
        return message
    summary = str(message.get("message") or "").strip()
    stack = str((message.get("extraInfo") or {}).get("py_callstack") or "")
    if not summary:
        return None
    # The rank whose log shows this exception line; the error file itself does not name it.
    where = next((name for name, text in texts.items()
                  if name.startswith("rank-") and summary in text), "a rank")
    body = "\n".join(stack.strip().splitlines()[-max_lines:])
    return f"{where}: {summary}\n{body}"


def error_text(rd: RunDir, max_lines: int = 25, since: dict[str, int] | None = None,
               root_cause: Path | None = None) -> str:
    """The most telling error of this attempt: the root cause a rank recorded (torchelastic's
    error file), else the first rank traceback, else the launcher's, in the logs past ``since``."""
    since = since or {}
    texts: dict[str, str] = {}
    for path in sorted(rd.logs_dir.glob("rank-*.log")) + sorted(rd.logs_dir.glob("launcher*.log")):
        if path.is_file():
            with path.open("rb") as fh:
                fh.seek(since.get(path.name, 0))
                texts[path.name] = fh.read().decode("utf-8", errors="replace")
    if root_cause is not None:
        found = _root_cause(root_cause, texts, max_lines)
        if found:
            return found
    logs = list(texts)
    for name in logs:
        lines = texts[name].splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        if starts:
            block = lines[starts[-1]:]
            # The exception line is the last non-indented line of the block.
            tail = [ln for ln in block if ln and not ln.startswith((" ", "\t"))]
            summary = tail[-1] if tail else block[-1]
            body = "\n".join(block[-max_lines:])
            return f"{name}: {summary}\n{body}"
    for name in reversed(logs):
        text = texts[name].strip().splitlines()
        if text:
            return f"{name}: " + "\n".join(text[-max_lines:])
    return "no log output; the processes died before writing anything"


def launcher_killed(rc: int | None) -> str:
    """What the ranks' logs cannot say: the launcher itself (:mod:`workbench.runs.launcher`, or torchrun
    across nodes) was killed by a signal (it would report a rank's death with an exit code), so
    the tail of a log is no cause."""
    if rc is None or rc >= 0:
        return ""
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return (f"the launcher of the ranks was killed by {name} from outside the run (the OOM killer, "
            "a user, the machine's scheduler); its ranks were stopped. job.resume() continues "
            "from the newest snapshot.\n")
