"""A run's money: its hourly price, whether a limit can be enforced, and the bill of each attempt.

GPU runs are priced per card-hour from ``budget.price_per_gpu_hour`` or else the GPU table
(:mod:`workbench.targets.gpus`, editable in WORKBENCH_HOME/gpus.yaml); CPU runs per process-core-hour from
``budget.price_per_cpu_core_hour`` (default 0).

An attempt is billed from the moment its resources are held to the moment its supervisor exits:
start-up, training, every automatic restart, saving and the reproduce bundle. The resources are
held from the supervisor's start (on Slurm the allocation starts it; a CPU run's ranks use their
cores from then on), except for a GPU run started on a standby (:mod:`workbench.runs.standby`),
whose ranks wait on the CPU while launch plans and prepares the data: its cards are leased at
the go, and it is billed from then. The status-writing supervisor owns the bill (:class:`AttemptBill`):
it records ``attempt_started`` and ``billed_before_s`` (what earlier attempts billed) in
status.json, rewrites ``billed_s``/``cost`` every few seconds and writes the final bill just before
it exits. The ranks compute the same running cost from that baseline (:class:`Billing`), so their
graceful stop and the supervisor's bill agree. A limit that cannot be enforced (no price, another
currency, already spent) is refused before anything starts (:func:`check_enforceable`).

    >>> hourly_price(RunSpec(resources={"gpus_per_node": 2, "gpu_type": "A100-80G"}))
    (7.5, 'CNY')
"""

from __future__ import annotations

import time
from typing import Any

from workbench.errors import BudgetError
from workbench.spec import RunSpec

# What is still paid after the ranks have ended: the launcher's exit, the reproduce bundle (the
# package list, checksums of every snapshot) and the final status write, with a margin so it is
# never short; plus one more supervisor that starts, finds the budget spent and leaves at once
# (what a Slurm requeue of an ended run costs). Basis: docs/planning.md. A big run's snapshot
# time is covered by the ranks' measured stop time (Billing.shutdown_s).
RELEASE_S = 6.0
# A rank's graceful stop (final snapshot, saving the adapter, leaving the process group) before
# any snapshot has been timed.
STOP_S = 5.0
# When the supervisor stops the ranks itself (the budget ran out before they could stop: start-up,
# a stop slower than its estimate), SIGKILL follows SIGTERM after this long.
KILL_GRACE_S = 3.0
TICK_S = 2.0  # how often the supervisor rewrites billed_s/cost while the ranks run


def billed_units(spec: RunSpec) -> int:
    """What the bill counts: cards on a GPU run, processes on a CPU run."""
    r = spec.resources
    return r.world_size if r.gpus_per_node == 0 else r.gpus_per_node * r.nodes


def unit_price(spec: RunSpec, gpu_name: str | None = None) -> tuple[float | None, str, str]:
    """(price per hour of one billed unit or None when unknown, its currency, where it came from).

    ``gpu_name`` prices the run on that card instead of the spec's (the planner's suggestions
    price other cards with it); the bill and the plan both ask here, so they cannot disagree.
    """
    r, b = spec.resources, spec.budget
    if r.gpus_per_node == 0:
        return b.price_per_cpu_core_hour, b.currency, "budget.price_per_cpu_core_hour"
    if b.price_per_gpu_hour is not None:
        return b.price_per_gpu_hour, b.currency, "budget.price_per_gpu_hour"
    from workbench.targets.gpus import detect_gpu_type, get_gpu

    # Only a local run can look at its own cards; a remote one must name its type.
    name = gpu_name or r.gpu_type or (detect_gpu_type() if spec.target == "local" else None)
    if name is None:
        return None, b.currency, "no GPU type known (resources.gpu_type is unset)"
    gpu = get_gpu(name)
    if gpu.price_per_hour is None:
        return None, gpu.currency, f"the GPU table has no price for {gpu.name}"
    return gpu.price_per_hour, gpu.currency, f"the GPU table's price for {gpu.name}"


def _price(spec: RunSpec) -> tuple[float | None, str, str]:
    """(price per hour of the whole run or None when unknown, its currency, where it came from)."""
    price, currency, source = unit_price(spec)
    return (None if price is None else price * billed_units(spec)), currency, source


def hourly_price(spec: RunSpec) -> tuple[float, str]:
    """(price per hour of the whole run, currency); 0 when unknown (then no limit is accepted)."""
    price, currency, _ = _price(spec)
    return (price or 0.0), currency


def cost(spec: RunSpec, seconds: float) -> float:
    price, _ = hourly_price(spec)
    return price * seconds / 3600.0


def check_enforceable(spec: RunSpec, spent: float = 0.0) -> None:
    """Refuse a ``budget.limit`` that could not be kept: no price, another currency, or spent.

    Called by launch() before anything is checked or written, and by Job.resume() (with what the
    run has spent so far). A run without a limit is never refused.
    """
    limit, want = spec.budget.limit, spec.budget.currency
    if limit is None:
        return
    price, currency, source = _price(spec)
    if price is None:
        raise BudgetError(
            f"budget.limit is {limit:g} {want} but the run's price is unknown ({source}), so the "
            f"limit could not be enforced. Set budget.price_per_gpu_hour, set resources.gpu_type "
            f"to a priced card, or add the card's price_per_hour to WORKBENCH_HOME/gpus.yaml "
            f"(workbench.targets.gpus.edit_gpu(NAME, price_per_hour=P, currency={want!r}))")
    if currency != want:
        raise BudgetError(
            f"budget.limit is in {want} but {source} is in {currency}; a limit is only kept in "
            f"the currency it is priced in. Set budget.currency: {currency}, or set "
            f"budget.price_per_gpu_hour in {want}")
    floor = spent + price * (KILL_GRACE_S + RELEASE_S) / 3600.0
    if floor >= limit:
        raise BudgetError(
            f"budget.limit {limit:g} {want} is spent: {spent:.4g} {want} billed so far, and "
            f"starting the run and releasing it again costs about {floor - spent:.4g} more "
            f"(at {price:g} {want}/h). Give a larger limit, e.g. "
            f"job.resume(**{{'budget.limit': {max(limit, spent) * 2:.4g}}}) or "
            f"`workbench resume RUN --budget N`")


def stop_note(status: dict[str, Any], limit: float, currency: str, run_id: str) -> str:
    """What a person reads when the budget stopped the run: where it stopped, how to go on."""
    step, total = status.get("step") or 0, status.get("total_steps")
    where = f"at step {step} of {total}" if step and total else "before the first step"
    snap = (status.get("snapshot") or {}).get("path")
    how = f"the newest snapshot is {snap}" if snap else "there is no snapshot"
    return (f"budget limit reached: {status.get('cost', 0.0):.4g} of {limit:g} {currency} spent "
            f"{where}; {how}. Continue it with a larger limit: "
            f"job.resume(**{{'budget.limit': N}}) or `workbench resume {run_id} --budget N`")


class Billing:
    """A rank's view of the running bill: the same baseline the supervisor bills from.

    ``status`` is status.json as the rank found it at start; without the supervisor's baseline
    (``attempt_started``) the bill starts now.
    """

    def __init__(self, spec: RunSpec, status: dict[str, Any] | None = None) -> None:
        status = status or {}
        self._time = time.time
        if status.get("attempt_started") is not None:
            self.start, self.before = float(status["attempt_started"]), float(
                status.get("billed_before_s") or 0.0)
        else:  # started without a billing supervisor: bill from now, after what was billed
            self.start, self.before = self._time(), float(status.get("billed_s") or 0.0)
        self.price_per_hour, self.currency = hourly_price(spec)
        self.limit = spec.budget.limit
        # Seconds a stop itself takes (final snapshot, saving the artefacts); raised to the
        # measured length of the last snapshot, so a big model stops early enough.
        self.shutdown_s = STOP_S

    def seconds(self) -> float:
        return self.before + self._time() - self.start

    def cost(self) -> float:
        return self.price_per_hour * self.seconds() / 3600.0

    def would_exceed(self, next_seconds: float) -> bool:
        """Would running ``next_seconds`` more, then stopping and releasing, pass the limit?"""
        if self.limit is None:
            return False
        ahead = next_seconds + self.shutdown_s + RELEASE_S
        return self.cost() + self.price_per_hour * ahead / 3600.0 > self.limit


class AttemptBill:
    """The supervisor's bill of one attempt: ``start`` on arrival, ``tick`` while the ranks run,
    ``close`` just before it exits. A supervisor that does not write status.json (nodes other
    than 0) bills nothing: node 0's price covers every node."""

    def __init__(self, rd: Any, spec: RunSpec, writes_status: bool = True,
                 since: float | None = None) -> None:
        self.rd, self.active = rd, writes_status
        self.price_per_hour, self.currency = hourly_price(spec)
        self.limit = spec.budget.limit
        self.stopped = False  # the supervisor stopped the ranks because the budget ran out
        self._written = 0.0
        import psutil

        # From the process's own start (its interpreter and imports hold the resources too), or
        # from ``since``: when a standby's cards were leased.
        self.start = since or psutil.Process().create_time()
        self.before = 0.0
        if self.active:
            status = rd.status() if rd.status_file.exists() else {}
            self.before = float(status.get("billed_s") or 0.0)
            rd.write_status(attempt_started=self.start, billed_before_s=self.before,
                            currency=self.currency, price_per_hour=self.price_per_hour,
                            **self._bill(self.start))

    def _bill(self, now: float) -> dict[str, float]:
        seconds = self.before + now - self.start
        return {"billed_s": seconds, "cost": self.price_per_hour * seconds / 3600.0}

    def spent(self) -> bool:
        """Would stopping now, then releasing, pass the limit? (Before torchrun and every tick.)"""
        if not self.active or self.limit is None:
            return False
        cost = self._bill(time.time())["cost"]
        return cost + self.price_per_hour * (KILL_GRACE_S + RELEASE_S) / 3600.0 > self.limit

    def tick(self) -> bool:
        """Bill the time so far (every TICK_S); True once the supervisor must stop the ranks."""
        if not self.active:
            return False
        now = time.time()
        if now - self._written >= TICK_S:
            self.rd.write_status(**self._bill(now))
            self._written = now
        if not self.stopped and self.spent():
            self.stopped = True
            print("supervisor: the budget is spent; stopping the ranks", flush=True)
        return self.stopped

    def close(self) -> dict[str, Any]:
        """The final bill (fields for the terminal status write), and the note of a budget stop."""
        if not self.active:
            return {}
        final: dict[str, Any] = self._bill(time.time())
        status = {**self.rd.status(), **final}
        if self.stopped or status.get("stop_reason") == "budget":
            final["stop_reason"] = "budget"
            final["note"] = stop_note(status, self.limit or 0.0, self.currency, self.rd.path.name)
        return final
