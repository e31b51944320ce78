"""``python -m workbench.supervise RUN_DIR``: start the ranks of one node and record how they ended.

The supervisor is the one process per run (per node) that outlives the notebook kernel: the local
backend starts it in a new session, so a kernel restart does not kill training. It starts
torchrun, forwards a cancel (SIGTERM) to every rank, kills stragglers, and writes the terminal
state to status.json: succeeded, failed (with the error text from the rank logs) or cancelled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from workbench.rundir import CANCELLED, FAILED, RUNNING, SUCCEEDED, RunDir

CANCEL_GRACE_S = 20.0  # SIGTERM first, SIGKILL after this long


def torchrun_command(run_dir: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "workbench.train", str(run_dir)]


def error_text(rd: RunDir, max_lines: int = 25) -> str:
    """The most telling error in the run's logs: the first rank traceback, else the launcher's."""
    logs = sorted(rd.logs_dir.glob("rank-*.log")) + [rd.logs_dir / "launcher.log"]
    for path in logs:
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        if starts:
            block = lines[starts[-1]:]
            # The exception line is the last non-indented line of the block.
            tail = [ln for ln in block if ln and not ln.startswith((" ", "\t"))]
            summary = tail[-1] if tail else block[-1]
            body = "\n".join(block[-max_lines:])
            return f"{path.name}: {summary}\n{body}"
    for path in reversed(logs):
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            if text:
                return f"{path.name}: " + "\n".join(text[-max_lines:])
    return "no log output; the processes died before writing anything"


def supervise(run_dir: str) -> int:
    rd = RunDir(run_dir)
    spec = rd.spec()
    cmd = torchrun_command(rd.path, spec.resources.procs_per_node)
    rd.write_status(state=RUNNING, supervisor_pid=os.getpid(), host=socket.gethostname(),
                    command=cmd)
    cancel_at: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        if not cancel_at:
            cancel_at.append(time.time())
            print(f"supervisor: signal {signum}, stopping the ranks", flush=True)
            _signal_group(child.pid, signal.SIGTERM)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (rd.logs_dir / "launcher.log").open("ab") as log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=env, cwd=rd.path, start_new_session=True)
    rd.write_status(launcher_pid=child.pid)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while True:
        try:
            rc = child.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if cancel_at and time.time() - cancel_at[0] > CANCEL_GRACE_S:
                _signal_group(child.pid, signal.SIGKILL)
    _signal_group(child.pid, signal.SIGKILL)  # ranks that outlived torchrun
    ended = time.time()
    if cancel_at:
        rd.write_status(state=CANCELLED, ended=ended, exit_code=rc)
    elif rc == 0 and rd.artefact_dir() is not None:
        rd.write_status(state=SUCCEEDED, ended=ended, exit_code=rc)
    else:
        rd.write_status(state=FAILED, ended=ended, exit_code=rc, error=error_text(rd))
    return 0


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m workbench.supervise RUN_DIR\n")
        sys.exit(2)
    sys.exit(supervise(sys.argv[1]))
