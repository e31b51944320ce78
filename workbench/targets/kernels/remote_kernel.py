"""The kernel process on the target: "Python (Workbench)" plus what its provisioner reads back.

``python -m workbench.targets.kernels.remote_kernel -f CONNECTION_FILE`` runs on the SSH host (or as the
Slurm step) that :mod:`workbench.targets.kernels.placement` chose. Beside the connection file it writes
``identity.json`` (this process's :class:`~workbench.runs.procs.ProcessIdentity`, so the provisioner
signals this very process and never a reused PID) and keeps ``activity.json`` current
(``{"busy": bool, "since": time}``, rewritten before and after every cell) for the idle cull.
With ``WORKBENCH_KERNEL_ORPHAN_S`` set (the provisioner sets it) it watches its client's heartbeat
and ends itself once the client is gone (:mod:`workbench.targets.kernels.heartbeat`); any exit it makes
itself is recorded in ``ended.json``, which the bill of a client that died is settled from.
Everything else is :mod:`workbench.targets.kernels.kernel`: the magics, widgets and startup imports.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

from workbench.targets.kernels.heartbeat import ENDED_FILE, ORPHAN_ENV, watch
from workbench.targets.kernels.heartbeat import write_json as _write


def main(argv: list[str] | None = None) -> None:
    from ipykernel.kernelapp import IPKernelApp

    from workbench.runs.procs import ProcessIdentity
    from workbench.targets.kernels.kernel import STARTUP_LINES

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
    atexit.register(lambda: _write(folder / ENDED_FILE, {"ended": time.time(),
                                                         "reason": "the kernel exited"}))
    if os.environ.get(ORPHAN_ENV):
        watch(folder, float(os.environ[ORPHAN_ENV]))
    app.start()


if __name__ == "__main__":
    main()
