"""The heartbeat between a remote kernel and its client: a kernel whose client is gone ends itself.

Client side, :class:`Beater` (a thread of the process that runs the provisioner, usually the
Jupyter server): every :data:`BEAT_EVERY_S` it writes a new beat into ``heartbeat`` in the
kernel's folder on the target (one command over the tunnel's SSH connection; a plain write on a
Slurm login node) and rewrites the session's bill. Nothing else has to keep it going: a client that
is killed, exits without shutting the kernel down, or loses its network simply stops beating.

Kernel side, :func:`watch` (a thread of the kernel process, armed when the provisioner sets
``WORKBENCH_KERNEL_ORPHAN_S``): it reads ``heartbeat`` every :data:`CHECK_EVERY_S` and, once its
content has not changed for that many seconds of the kernel's own monotonic clock (no clock of the
client is compared), writes ``ended.json`` (``{"ended": time, "reason": ...}``), stops its child
processes (SIGTERM, then SIGKILL after :data:`CHILD_GRACE_S`) and exits. On Slurm the job's script
``exec``\\ s the kernel's step, so the allocation ends with it.

:func:`bound_s` is what docs/kernels.md promises: from the client's death until the kernel is
gone (and on Slurm its allocation left the queue). The client's last beat came before its death,
so the kernel ends at most its orphan time (:data:`ORPHAN_AFTER_S` unless the kernelspec says
``orphan_after_s``) + :data:`CHECK_EVERY_S` + :data:`CHILD_GRACE_S` after it; the rest of the
bound is for Slurm ending the job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BEAT_EVERY_S = 5.0
ORPHAN_AFTER_S = 30.0
CHECK_EVERY_S = 1.0
CHILD_GRACE_S = 3.0
BOUND_SLACK_S = 15.0  # over the orphan time: the check, the children's grace, Slurm's end
MIN_ORPHAN_S = 2 * BEAT_EVERY_S  # a shorter wait would end a kernel whose client missed one beat
ORPHAN_ENV = "WORKBENCH_KERNEL_ORPHAN_S"  # set by the provisioner: the kernel watches its beats
HEARTBEAT_FILE = "heartbeat"
ENDED_FILE = "ended.json"


class Beater:
    """Call ``beat(n)`` (n = 1, 2, ...) every ``every`` seconds in a daemon thread until
    :meth:`stop`. A beat that fails is logged and the next one tried: a host that is briefly
    unreachable must not end the kernel before the kernel's own timeout would."""

    def __init__(self, beat: Callable[[int], None], log: Any, every: float = BEAT_EVERY_S,
                 name: str = "kernel") -> None:
        self._beat, self._log, self._every = beat, log, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"workbench-heartbeat-{name}",
                                        daemon=True)

    def start(self) -> Beater:
        self._thread.start()
        return self

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self._beat(n)
            except Exception as exc:  # noqa: BLE001 - a failed beat is retried at the next one
                self._log.warning("heartbeat %d to the kernel failed: %s", n, exc)
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()


def beat_command(folder: str, n: int) -> str:
    """The shell command that writes beat ``n`` into the kernel's ``folder`` on the target."""
    from workbench.targets.secrets import remote_quote

    path = remote_quote(f"{folder.rstrip('/')}/{HEARTBEAT_FILE}")
    return f"umask 077; printf '%s %s' {n} {time.time():.3f} > {path}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def bound_s(orphan_after_s: float = ORPHAN_AFTER_S) -> float:
    """Seconds from a client's death until its kernel is gone (docs/kernels.md)."""
    return orphan_after_s + BOUND_SLACK_S


def watch(folder: Path, orphan_after_s: float) -> threading.Thread:
    """Start the kernel side's watch of ``folder/heartbeat`` (see the module's docstring)."""

    def run() -> None:
        seen, changed = _read(folder / HEARTBEAT_FILE), time.monotonic()
        while True:
            time.sleep(CHECK_EVERY_S)
            now = _read(folder / HEARTBEAT_FILE)
            if now != seen:
                seen, changed = now, time.monotonic()
            elif time.monotonic() - changed > orphan_after_s:
                end_orphan(folder, f"no heartbeat from its client for {orphan_after_s:.0f} s")

    thread = threading.Thread(target=run, name="workbench-heartbeat-watch", daemon=True)
    thread.start()
    return thread


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def end_orphan(folder: Path, reason: str) -> None:
    """Record the end, stop this process's children, and exit this process."""
    import psutil

    print(f"workbench kernel: {reason}; ending the kernel", file=sys.stderr, flush=True)
    try:
        write_json(folder / ENDED_FILE, {"ended": time.time(), "reason": reason})
    except OSError:
        pass  # the end is still seen: by Slurm, or as the process gone
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            continue
    for child in psutil.wait_procs(children, timeout=CHILD_GRACE_S)[1]:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue
    os._exit(0)
