"""What a run costs while it runs: the hourly price of its resources and the cost so far.

GPU runs are priced per card-hour from ``budget.price_per_gpu_hour`` or else the GPU table
(:mod:`workbench.gpus`, editable in WORKBENCH_HOME/gpus.yaml); CPU runs per process-core-hour from
``budget.price_per_cpu_core_hour`` (default 0). Cost accumulates across resumes.

    >>> hourly_price(RunSpec(resources={"gpus_per_node": 2, "gpu_type": "A100-80G"}))
    (7.5, 'CNY')
"""

from __future__ import annotations

from workbench.spec import RunSpec


def hourly_price(spec: RunSpec) -> tuple[float, str]:
    """(price per hour of the whole run, currency)."""
    r, b = spec.resources, spec.budget
    if r.gpus_per_node == 0:
        return b.price_per_cpu_core_hour * r.world_size, b.currency
    cards = r.gpus_per_node * r.nodes
    if b.price_per_gpu_hour is not None:
        return b.price_per_gpu_hour * cards, b.currency
    from workbench.gpus import detect_gpu_type, get_gpu

    name = r.gpu_type or detect_gpu_type()
    if name is None:
        return 0.0, b.currency
    gpu = get_gpu(name)
    return (gpu.price_per_hour or 0.0) * cards, gpu.currency or b.currency


def cost(spec: RunSpec, seconds: float) -> float:
    price, _ = hourly_price(spec)
    return price * seconds / 3600.0


class Billing:
    """Seconds and cost of a run across attempts: what earlier attempts billed plus this one."""

    def __init__(self, spec: RunSpec, billed_before_s: float = 0.0) -> None:
        import time

        self._time = time.time
        self.start = self._time()
        self.before = billed_before_s
        self.price_per_hour, self.currency = hourly_price(spec)
        self.limit = spec.budget.limit
        # Seconds a stop itself takes (final snapshot, saving the artefacts); raised to the
        # measured length of the last snapshot, so a big model stops early enough.
        self.shutdown_s = 3.0

    def seconds(self) -> float:
        return self.before + self._time() - self.start

    def cost(self) -> float:
        return self.price_per_hour * self.seconds() / 3600.0

    def stop_note(self, cost: float, run_id: str, step: int, total_steps: int) -> str:
        """What a person reads when the budget stopped the run: where it stopped, how to go on."""
        return (f"budget limit reached: {cost:.4g} of {self.limit:g} {self.currency} spent "
                f"at step {step} of {total_steps}; the run stopped with a snapshot. Continue it "
                f"with a larger limit: job.resume(**{{'budget.limit': N}}) or "
                f"`workbench resume {run_id} --budget N`")

    def would_exceed(self, next_seconds: float) -> bool:
        """Would running ``next_seconds`` more, and then stopping, pass the limit?"""
        if self.limit is None:
            return False
        ahead = next_seconds + self.shutdown_s
        return self.cost() + self.price_per_hour * ahead / 3600.0 > self.limit
