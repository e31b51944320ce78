"""Exports started from the panel: one ``workbench export`` process per run, and what it says.

The panel's Export asks for formats (merged, gguf, ollama) and GGUF types; :func:`start` runs
``python -P -m workbench.cli export RUN ...`` detached, in the run's ``export/`` folder, its output
in ``export/panel.log`` and its identity in ``export/panel.json`` (a second export of the run is
refused while the first lives). The export itself is the library's (workbench.serve.export_run:
planned, verified by running the result, charged to a wallet like an evaluation, its report in
the run's status.json); :func:`state` is what the Details view shows of it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs.jobs import Job
from workbench.runs.procs import ProcessIdentity

FORMATS = ("merged", "gguf", "ollama")
_QUANT = re.compile(r"[a-z0-9_]{2,12}")
LOG, RECORD = "panel.log", "panel.json"


class ExportRequestError(WorkbenchError, ValueError):
    """An export asked for wrongly (formats, GGUF types): a 400."""


class ExportBusyError(WorkbenchError):
    """An export the run cannot have now (one under way, no weights yet): a 409."""


def _alive(record: dict[str, Any]) -> bool:
    """Whether the export process the record names still runs (by PID and start time)."""
    try:
        return ProcessIdentity.from_dict(record["process"]).process() is not None
    except (KeyError, TypeError, ValueError):
        return False


def _record(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def start(job: Job, formats: Any, quant: Any) -> dict[str, Any]:
    """Start exporting ``job`` to ``formats`` (GGUF types ``quant``); returns at once."""
    if not isinstance(formats, list) or not formats or not set(formats) <= set(FORMATS):
        raise ExportRequestError(f"formats must be a list of {', '.join(FORMATS)}")
    quant = quant if quant is not None else ["f16"]
    if not isinstance(quant, list) or not quant or not all(
            isinstance(q, str) and _QUANT.fullmatch(q) for q in quant):
        raise ExportRequestError('quant must be a list of GGUF types, e.g. ["f16", "q4_k_m"]')
    if job.state != "succeeded":
        raise ExportBusyError(f"run {job.id} is {job.state}; only a run that succeeded has "
                                 "weights to export")
    folder = job.run_dir.path / "export"
    folder.mkdir(exist_ok=True)
    if _alive(_record(folder)):
        raise ExportBusyError(f"an export of {job.id} is under way; wait for it (Details "
                                 "shows its progress)")
    argv = [sys.executable, "-P", "-m", "workbench.cli", "export", job.id,
            "--format", ",".join(formats), "--quant", ",".join(quant)]
    # The log is read by people in Details: the export's own lines, no progress bars.
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    with (folder / LOG).open("w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, env=env,
                                stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    record = {"process": ProcessIdentity.of(proc.pid, "export").to_dict(), "formats": formats,
              "quant": quant}
    (folder / RECORD).write_text(json.dumps(record))
    return {"id": job.id, "exporting": True, "formats": formats, "quant": quant}


def state(job: Job, tail: int = 8) -> dict[str, Any] | None:
    """What Details shows: an export under way (its last log lines) or ended (how, from its
    log's last line), and the last finished export's report (status.json)."""
    folder = job.run_dir.path / "export"
    record = _record(folder)
    report = job.run_dir.status().get("export")
    if not record and not report:
        return None
    out: dict[str, Any] = {"running": _alive(record) if record else False,
                           "formats": record.get("formats"), "report": report}
    try:
        lines = (folder / LOG).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    out["log"] = lines[-tail:]
    return out
