"""The pre-launch planner: will this run fit, how is it parallelised, how long, what will it cost.

``plan(spec)`` counts the model's parameters from its config (instantiated on the meta device, so
nothing is downloaded), estimates the peak memory of every GPU (or CPU process) for every method x
strategy x offload combination, picks the cheapest strategy that fits with a safety margin, and
prices the run from the GPU table (:mod:`workbench.targets.gpus`). Launch refuses a plan that does not fit
(:func:`check_fits`), and ``parallel.strategy: auto`` asks :func:`choose_strategy`. Every formula
is written out, with its sources and measured tolerances, in ``docs/planning.md``.

    >>> p = plan(RunSpec(train={"max_steps": 10}))  # doctest: +SKIP
    >>> p.fits, p.strategy.label
    (True, 'lora + ddp')

The modules follow the data, and this one re-exports their public names:
:mod:`~workbench.plan.shape` (the model's shape) -> :mod:`~workbench.plan.memory` (peak memory of
a strategy) -> :mod:`~workbench.plan.timing` (data, step time) -> :mod:`~workbench.plan.inputs`
(the card, precision and optimizers planned for) -> :mod:`~workbench.plan.planner` (every strategy
evaluated, the choice) -> :mod:`~workbench.plan.suggest` (changes, each re-planned), which returns
a :class:`Plan`
(:mod:`~workbench.plan.result`). The clock under the time estimate is measured by
:mod:`~workbench.plan.calibrate` (``calibrate("local")``) and learnt from ended runs by
:mod:`~workbench.plan.history`.
"""

from workbench.errors import PlanError
from workbench.plan.calibrate import Calibration, CalibrationWarning, calibrate
from workbench.plan.memory import (
    GiB,
    MemoryBreakdown,
    Method,
    Parallel,
    Strategy,
    all_strategies,
    estimate_memory,
    safety_margin_gib,
)
from workbench.plan.planner import _setup as _setup
from workbench.plan.planner import check_fits, choose_strategy, plan
from workbench.plan.result import Candidate, Plan, Suggestion
from workbench.plan.shape import OFFLINE_CONFIGS, ModelShape, model_shape
from workbench.plan.shape import _config_for as _config_for
from workbench.plan.timing import DataEstimate, estimate_data, step_seconds

__all__ = [
    "OFFLINE_CONFIGS",
    "Calibration",
    "CalibrationWarning",
    "Candidate",
    "DataEstimate",
    "GiB",
    "MemoryBreakdown",
    "Method",
    "ModelShape",
    "Parallel",
    "Plan",
    "PlanError",
    "Strategy",
    "Suggestion",
    "all_strategies",
    "calibrate",
    "check_fits",
    "choose_strategy",
    "estimate_data",
    "estimate_memory",
    "model_shape",
    "plan",
    "safety_margin_gib",
    "step_seconds",
]
