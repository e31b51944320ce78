"""The kernel process on the target: "Python (Workbench)" plus what its provisioner reads back.

``python -m workbench.kernels.remote_kernel -f CONNECTION_FILE`` runs on the SSH host (or as the
Slurm step) that :mod:`workbench.kernels.placement` chose. Beside the connection file it writes
``identity.json`` (this process's :class:`~workbench.runs.procs.ProcessIdentity`, so the provisioner
signals this very process and never a reused PID) and keeps ``activity.json`` current
(``{"busy": bool, "since": time}``, rewritten before and after every cell) for the idle cull.
Everything else is :mod:`workbench.kernels.kernel`: the magics, widgets and startup imports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def main(argv: list[str] | None = None) -> None:
    from ipykernel.kernelapp import IPKernelApp

    from workbench.kernels.kernel import STARTUP_LINES
    from workbench.runs.procs import ProcessIdentity

    argv = sys.argv[1:] if argv is None else argv
    conn = Path(argv[argv.index("-f") + 1]).expanduser()
    folder = conn.parent
    _write(folder / "identity.json", ProcessIdentity.me("kernel").to_dict())
    activity = folder / "activity.json"
    app = IPKernelApp.instance(extensions=["workbench"], exec_lines=STARTUP_LINES)
    app.initialize(argv)
    events = app.shell.events  # type: ignore[union-attr]
    events.register("pre_run_cell", lambda *_: _write(activity, {"busy": True,
                                                                 "since": time.time()}))
    events.register("post_run_cell", lambda *_: _write(activity, {"busy": False,
                                                                  "since": time.time()}))
    _write(activity, {"busy": False, "since": time.time()})  # idle from when it can answer
    app.start()


if __name__ == "__main__":
    main()
