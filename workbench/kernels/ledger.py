"""The bill of remote kernels: one JSON file per kernel session, priced like a run's resources.

A session is one start of a remote kernel (a restart opens a new one): it holds its node, and on
Slurm its allocation, from ``started`` (when the kernel process started, or when Slurm started the
allocation) until ``ended`` (when the provisioner saw the kernel gone and the allocation
released). The provisioner rewrites ``billed_s`` and ``cost`` at every poll (every few seconds),
so a Jupyter server that dies mid-session leaves a bill up to its last poll, never a guess past it.
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
    runs, ``close`` once it is gone."""

    def __init__(self, kernel_id: str, target: str, gpus: int, job: str | None = None) -> None:
        self.path = sessions_dir() / f"{kernel_id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        price, currency = hourly_price(target, gpus)
        self.data: dict[str, Any] = {"kernel_id": kernel_id, "target": target, "gpus": gpus,
                                     "job": job, "price_per_hour": price, "currency": currency,
                                     "started": None, "ended": None, "billed_s": 0.0, "cost": 0.0}

    def open(self, started: float, job: str | None = None) -> None:
        self.data.update(started=started, job=job)
        self.bill()

    def bill(self, now: float | None = None) -> None:
        if self.data["started"] is None or self.data["ended"] is not None:
            return
        seconds = max(0.0, (now or time.time()) - self.data["started"])
        self.data.update(billed_s=seconds, cost=self.data["price_per_hour"] * seconds / 3600.0)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    def close(self, reason: str = "shut down") -> None:
        if self.data["started"] is None or self.data["ended"] is not None:
            return
        now = time.time()
        self.bill(now)
        self.data.update(ended=now, reason=reason)
        write_json_atomic(self.path, self.data)


def sessions() -> list[dict[str, Any]]:
    """Every recorded kernel session, oldest first."""
    out = []
    for p in sorted(sessions_dir().glob("*.json")) if sessions_dir().is_dir() else []:
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda s: s.get("started") or 0.0)


def spent(kernel_id: str) -> float:
    """What the ended sessions of one kernel cost (a restart keeps the kernel id)."""
    return sum(float(s.get("cost") or 0.0) for s in sessions()
               if s.get("kernel_id") == kernel_id and s.get("ended"))


def total() -> dict[str, float]:
    """What every kernel session cost, per currency."""
    sums: dict[str, float] = {}
    for s in sessions():
        sums[s["currency"]] = sums.get(s["currency"], 0.0) + float(s.get("cost") or 0.0)
    return sums
