"""The bill of remote kernels: one JSON file per kernel session, priced like a run's resources.

A session is one start of a remote kernel (a restart opens a new one): it holds its node, and on
Slurm its allocation, from ``started`` (when the kernel process started, or when Slurm started the
allocation) until ``ended`` (when the provisioner saw the kernel gone and the allocation
released). The provisioner rewrites ``billed_s`` and ``cost`` at every poll and heartbeat (every
few seconds). A session also names its client (the process running the provisioner) and where the
kernel runs; once that client is gone without closing it (killed, or an exit that could not shut
the kernel down), :func:`settle` closes it with the kernel's life as its target saw it (Slurm's
Start/End, the kernel process's start and recorded end): :func:`sessions` and :func:`total` settle
first.
The hourly price is :func:`workbench.runs.budget.hourly_price` of a spec with the kernel's GPUs and the
target's defaults (``budget.price_per_gpu_hour`` or ``resources.gpu_type`` with a priced card;
``budget.price_per_cpu_core_hour`` for a CPU kernel), the same price a run on that target pays.

Files live in WORKBENCH_HOME/kernels/sessions/; :func:`sessions` reads them and :func:`total` sums
the cost per currency, for a budget that counts kernels with runs::

    >>> total()                                   # doctest: +SKIP
    {'USD': 1.73}
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from workbench.runs.home import home
from workbench.runs.rundir import write_json_atomic


def sessions_dir() -> Path:
    return home() / "kernels" / "sessions"


def hourly_price(target_ref: str, gpus: int) -> tuple[float, str]:
    """(price per hour, currency) of a kernel with ``gpus`` GPUs (one process) on the target."""
    from workbench.runs.budget import hourly_price as run_price
    from workbench.spec import RunSpec
    from workbench.targets.named import apply_defaults, get_target

    spec = apply_defaults(RunSpec(target=target_ref), get_target(target_ref))
    spec = spec.updated(**{"resources.gpus_per_node": gpus, "resources.nodes": 1,
                           "resources.processes_per_node": 1})
    return run_price(spec)


class Session:
    """One kernel session's record: ``open`` when the kernel holds its node, ``bill`` while it
    runs (the provisioner's polls and heartbeats), ``close`` once it is gone."""

    def __init__(self, kernel_id: str, target: str, gpus: int, job: str | None = None,
                 orphan_after_s: float | None = None) -> None:
        from workbench.runs.procs import ProcessIdentity

        self.path = sessions_dir() / f"{kernel_id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        price, currency = hourly_price(target, gpus)
        self._lock = threading.Lock()  # the heartbeat's thread bills beside the polls
        self.data: dict[str, Any] = {
            "kernel_id": kernel_id, "target": target, "gpus": gpus, "job": job,
            "price_per_hour": price, "currency": currency, "started": None, "ended": None,
            "billed_s": 0.0, "cost": 0.0, "orphan_after_s": orphan_after_s,
            # Who keeps this bill; once it is gone, settle() closes it from the target's view.
            "client": ProcessIdentity.me("kernel client").to_dict(), "dir": None, "identity": None}

    @classmethod
    def load(cls, path: Path) -> Session:
        self = cls.__new__(cls)
        self.path, self._lock = path, threading.Lock()
        self.data = json.loads(path.read_text(encoding="utf-8"))
        return self

    def open(self, started: float, job: str | None = None, folder: str | None = None,
             identity: dict[str, Any] | None = None) -> None:
        """``folder``: the kernel's folder on the target; ``identity``: its process (SSH)."""
        self.data.update(started=started, job=job, dir=folder, identity=identity)
        self.bill()

    def bill(self, now: float | None = None) -> None:
        with self._lock:
            if self.data["started"] is not None and self.data["ended"] is None:
                self._write(now or time.time())

    def _write(self, until: float) -> None:
        seconds = max(0.0, until - self.data["started"])
        self.data.update(billed_s=seconds, cost=self.data["price_per_hour"] * seconds / 3600.0)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    def close(self, reason: str = "shut down", ended: float | None = None,
              started: float | None = None) -> None:
        """End the bill at ``ended`` (now); ``started`` replaces the start where the target
        knows it better."""
        with self._lock:
            if self.data["ended"] is not None or (self.data["started"] is None and not started):
                return
            if started:
                self.data["started"] = started
            ended = time.time() if ended is None else ended
            self.data.update(ended=ended, reason=reason)
            self._write(ended)


def settle(kernel_id: str | None = None) -> None:
    """Close the open sessions (of ``kernel_id``, or all) whose client is gone, with the kernel's
    life as its target saw it (:func:`workbench.targets.kernels.observe.observe`). A kernel that still
    runs is billed up to now and stays open; one whose end the target did not record is billed
    up to its last bill plus heartbeat.bound_s(), the longest it can have outlived its client; a
    target that cannot be reached is asked again at the next settle."""
    from workbench.errors import RemoteKernelError, TargetError
    from workbench.runs.procs import ProcessIdentity
    from workbench.targets.kernels.heartbeat import ORPHAN_AFTER_S, bound_s
    from workbench.targets.kernels.observe import observe

    for path in sorted(sessions_dir().glob("*.json")) if sessions_dir().is_dir() else []:
        try:
            session = Session.load(path)
        except (OSError, ValueError):
            continue
        d = session.data
        if d.get("ended") is not None or d.get("started") is None or not d.get("client") or \
                (kernel_id is not None and d.get("kernel_id") != kernel_id):
            continue
        client = ProcessIdentity.from_dict(d["client"])
        if not client.here or client.alive():
            continue  # its client keeps the bill (or runs on another machine: asked there)
        try:
            seen = observe(d)
        except (TargetError, RemoteKernelError):
            continue
        if seen["alive"]:
            session.data["started"] = seen["started"] or d["started"]
            session.bill()
            continue
        started = seen["started"] or d["started"]
        outlived = bound_s(d.get("orphan_after_s") or ORPHAN_AFTER_S)
        ended = seen["ended"] or min(time.time(), d["started"] + d["billed_s"] + outlived)
        session.close(f"its client ended; {seen['how']}", ended=ended, started=started)


def sessions(settled: bool = True) -> list[dict[str, Any]]:
    """Every recorded kernel session, oldest first; ``settled``: :func:`settle` them first."""
    if settled:
        settle()
    out = []
    for p in sorted(sessions_dir().glob("*.json")) if sessions_dir().is_dir() else []:
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda s: s.get("started") or 0.0)


def spent(kernel_id: str) -> float:
    """What the ended sessions of one kernel cost (a restart keeps the kernel id)."""
    return sum(float(s.get("cost") or 0.0) for s in sessions(settled=False)
               if s.get("kernel_id") == kernel_id and s.get("ended"))


def total() -> dict[str, float]:
    """What every kernel session cost, per currency."""
    sums: dict[str, float] = {}
    for s in sessions():
        sums[s["currency"]] = sums.get(s["currency"], 0.0) + float(s.get("cost") or 0.0)
    return sums
