"""``workbench.sweep(...)``: check everything a sweep is asked, record it, start its controller.

    >>> s = workbench.sweep(RunSpec(train={"max_steps": 12}),                 # doctest: +SKIP
    ...                     space={"train.lr": [1e-4, 1e-3], "method.lora_r": [4, 8]},
    ...                     budget=50, concurrent=2)
    >>> s.wait(); s.best                                                      # doctest: +SKIP

The same from YAML: a RunSpec file with a top-level ``sweep:`` section holding these arguments
(``workbench sweep spec.yaml``). Nothing is written before every argument has been accepted;
a bad one raises :class:`~workbench.errors.SweepError` saying what to give instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from workbench.errors import BudgetError, SpecError, SweepError
from workbench.spec import RunSpec
from workbench.sweep import record as rec
from workbench.sweep.handle import Sweep
from workbench.sweep.objective import Objective
from workbench.sweep.space import grid_size, parse_space
from workbench.sweep.study import PRUNERS, STRATEGIES

SWEEP_KEYS = ("space", "strategy", "trials", "objective", "direction", "budget", "concurrent",
              "seed", "pruner", "prune_after")


def _trials(strategy: str, trials: int | None, params: list[Any]) -> int:
    if strategy == "grid":
        size = grid_size(params)
        if trials is None:
            return size
        if not isinstance(trials, int) or not 1 <= trials <= size:
            raise SweepError(f"trials={trials!r}, but the grid has {size} points; give at most "
                             f"{size}, or leave trials out to try every point")
        return trials
    if trials is None:
        raise SweepError(f"strategy={strategy!r} needs trials=N (how many settings to try)")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise SweepError(f"trials must be a whole number of at least 1, not {trials!r}")
    return trials


def _budget(base: RunSpec, budget: float | None) -> float | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise SweepError(f"budget must be a positive amount in {base.budget.currency} (the "
                         f"sweep's total limit), not {budget!r}; or leave it out for no limit")
    from workbench.runs.budget import check_enforceable

    try:  # the same checks a run's own limit gets: a price, in the sweep's currency
        check_enforceable(base.updated(**{"budget.limit": float(budget)}))
    except BudgetError as exc:
        raise SweepError(f"the sweep's budget cannot be kept: {exc}") from None
    from workbench.runs.credit import run_status
    from workbench.runs.wallet import Wallet

    wallet = Wallet.open(status_of=run_status)
    if wallet is not None:  # its trials hold from the wallet one by one as they launch
        wallet.covers(float(budget), "the sweep's budget")
    return float(budget)


def sweep(spec: RunSpec | dict | str | Path | None = None, *, space: dict[str, Any] | None = None,
          strategy: str = "grid", trials: int | None = None, objective: str = "eval_loss",
          direction: str | None = None, budget: float | None = None, concurrent: int = 1,
          target: str | None = None, seed: int | None = 0, pruner: str = "median",
          prune_after: int = 2) -> Sweep:
    """Start a sweep of ``spec`` over ``space`` and return its :class:`Sweep` handle at once.

    ``strategy``: grid | random | optuna (TPE). ``objective``: "eval_loss" or
    "eval.<task>.<metric>"; ``direction`` defaults to minimize for losses, maximize for scores.
    ``budget``: the total for all trials, in the spec's budget.currency. ``concurrent``: trials
    running at once. ``pruner``: "median" (stop a trial whose objective is worse than the median
    of completed trials at the same step, once ``prune_after`` trials completed) or "none".
    """
    if os.environ.get("WORKBENCH_COURSE_URL"):  # a course hub's kernel: the course service
        from workbench.course.client import sweep_via_course  # holds, runs and charges it

        return sweep_via_course(  # type: ignore[return-value]  # a CourseSweep, Sweep-alike
            spec, space, target, strategy=strategy, trials=trials, objective=objective,
            direction=direction, budget=budget, concurrent=concurrent, seed=seed, pruner=pruner,
            prune_after=prune_after)
    base = RunSpec.coerce(spec)
    if target is not None:
        try:
            base = base.updated(target=target)
        except SpecError as exc:
            raise SweepError(f"target={target!r}: {exc}") from None
    if base.target != "local":  # a named target's defaults fill what the spec left unset
        from workbench.targets.named import apply_defaults, get_target

        base = apply_defaults(base, get_target(base.target))
    params = parse_space(space, base)
    if strategy not in STRATEGIES:
        raise SweepError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if pruner not in PRUNERS:
        raise SweepError(f"pruner {pruner!r} is not one of {', '.join(PRUNERS)}")
    total = _trials(strategy, trials, params)
    if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
        raise SweepError(f"concurrent must be a whole number of at least 1, not {concurrent!r}")
    obj = Objective.parse(objective, direction)
    if obj.name == "eval_loss" and base.data.validation_fraction == 0:
        raise SweepError("objective 'eval_loss' needs a validation split, but "
                         "data.validation_fraction is 0; set it (e.g. 0.1) or choose an "
                         "'eval.<task>.<metric>' objective")
    limit = _budget(base, budget)
    record = rec.SweepRecord(rec.sweeps_dir() / rec.new_sweep_id(base.name)).create({
        "name": base.name, "spec": base.model_dump(mode="json"),
        "space": {p.path: p.to_dict() for p in params}, "strategy": strategy,
        "trials_total": total, "objective": obj.name, "direction": obj.direction,
        "budget": limit, "currency": base.budget.currency, "concurrent": concurrent,
        "target": base.target, "seed": seed, "pruner": pruner, "prune_after": prune_after})
    from workbench.sweep.runner import start_controller

    start_controller(record)
    return Sweep(record)


def split_yaml(path: str | Path) -> tuple[RunSpec, dict[str, Any]]:
    """A RunSpec YAML file with a ``sweep:`` section: (the spec without it, sweep()'s arguments)."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"file {path} does not exist; check the path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise SpecError([("", f"not valid YAML: {exc}")], str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("sweep"), dict):
        raise SweepError(f"{path} has no 'sweep:' section; add one with at least 'space:' "
                         f"(e.g. sweep: {{space: {{train.lr: [1e-4, 1e-3]}}}})")
    section = data.pop("sweep")
    unknown = sorted(set(section) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown} in 'sweep:'; allowed: "
                         f"{', '.join(SWEEP_KEYS)}")
    return RunSpec.parse(data, str(path)), section


def sweep_yaml(path: str | Path) -> Sweep:
    spec, kwargs = split_yaml(path)
    return sweep(spec, **kwargs)
