"""The sweep's one budget: what it has spent (the final bills of its ended trials), what it holds
(the whole ``budget.limit`` of every trial under way) and what a trial is priced at before it
starts (the planner's cost with a margin, plus starting and releasing its processes).

A run never passes its own limit, so a trial that starts only when its price fits in what is
neither spent nor held keeps the sum of the trials' costs under the sweep's limit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, hourly_price
from workbench.spec import RunSpec
from workbench.sweep import record as rec

# The planner's price of a trial is an estimate (start-up on a busy machine is not in it): a trial
# starts only when this multiple of it, plus starting and releasing, fits in what is left.
PRICE_MARGIN = 1.5
# The share of its cores a CPU run alone keeps busy (it also waits on its disk and its ranks on
# each other); docs/sweeps.md gives the measurement.
BUSY = 0.8


def sharing(spec: RunSpec, at_once: int) -> float:
    """How many times longer a trial holds its processes because ``at_once`` trials run on this
    machine's CPU cores together (1: no slower).

    The planner times a run alone. Once the trials' processes outnumber the cores, they take
    turns on them, start-up and steps alike; a run alone keeps its cores BUSY of the time (it
    also waits on its disk and its ranks on each other), which the others' turns fill first.
    Trials on GPUs, or on other targets, share no cores here.
    """
    r = spec.resources
    if at_once <= 1 or spec.target != "local" or r.gpus_per_node != 0:
        return 1.0
    cores, procs = os.cpu_count() or 1, r.world_size
    share = at_once * procs / max(cores, procs)  # alone, a trial has its own cores
    return max(1.0, 1.0 + (share - 1.0) * BUSY)


def beside(alone_s: float, others_left_s: list[float], waiting: int, slots: int,
           slow: Callable[[int], float]) -> float:
    """How many times longer than ``alone_s`` a trial starting now runs: it shares the machine
    with the running trials (``others_left_s``: the seconds of work, at the pace of a run alone,
    each has left) and with the ``waiting`` trials that start, each as long as this one, whenever
    fewer than ``slots`` run. While ``k`` trials run, each goes ``slow(k)`` times slower than
    alone. The last trials of a sweep run partly alone once their neighbours end."""
    if alone_s <= 0:
        return 1.0
    mine, others, clock = alone_s, sorted(x for x in others_left_s if x > 0), 0.0
    while True:
        while waiting and len(others) + 1 < slots:
            others.append(alone_s)
            waiting -= 1
        factor = slow(len(others) + 1)
        first = min([mine, *others])  # the next trial to end, in seconds of work alone
        clock += first * factor
        mine -= first
        if mine <= 1e-9:
            return clock / alone_s
        others = [x - first for x in others if x - first > 1e-9]


class Price(NamedTuple):
    """A trial's price before it starts."""

    planned: float | None  # the planner's cost, slowed by the trials beside it
    need: float  # what the controller sets aside: planned x PRICE_MARGIN, plus start and release
    shared: float  # the slowdown it was priced for (1: alone)
    alone_s: float | None  # the planner's time for it alone, in seconds


def trial_price(spec: RunSpec, others_left_s: list[float] | None = None, waiting: int = 0,
                slots: int = 1) -> Price:
    """The planner's price of a trial of ``spec`` that starts beside the running trials
    (``others_left_s``, see :func:`left_s`) with ``waiting`` more to start after it, ``slots`` at
    once (:func:`beside`, :func:`sharing`)."""
    from workbench.plan import plan

    planned = plan(spec).cost
    per_hour, _ = hourly_price(spec)
    shared, alone_s = 1.0, None
    if planned is not None and per_hour > 0:
        alone_s = planned / per_hour * 3600.0
        shared = beside(alone_s, others_left_s or [], waiting, slots, lambda k: sharing(spec, k))
        planned *= shared
    need = (planned or 0.0) * PRICE_MARGIN + per_hour * (KILL_GRACE_S + RELEASE_S) / 3600.0
    return Price(planned, need, shared, alone_s)


def left_s(trial: dict[str, Any], now: float, default: float) -> float:
    """The seconds of work, at the pace of a run alone, a running trial has left: its planned
    time alone less what it has run at the slowdown it was priced for (``default`` for a trial
    recorded without its plan)."""
    if trial.get("alone_s") is None or trial.get("launched") is None:
        return default
    ran = (now - float(trial["launched"])) / float(trial.get("sharing") or 1.0)
    return max(0.0, float(trial["alone_s"]) - ran)


def spent(data: dict[str, Any]) -> float:
    """What the sweep has spent: the final bills of its ended trials."""
    return sum(float(t.get("cost") or 0.0) for t in data["trials"] if t.get("released"))


def held(data: dict[str, Any]) -> float:
    """What the sweep holds for trials under way: their limits (not spent yet)."""
    return sum(float(t["limit"]) for t in data["trials"] if not t.get("released") and
               t.get("state") not in (rec.WAITING, rec.SKIPPED) and t.get("limit") is not None)


def money(data: dict[str, Any]) -> str:
    """'spent 12.3 · held 40 of 100 CNY': what was spent and what is held, apart."""
    budget = f" of {data['budget']:g}" if data.get("budget") else ""
    holding = held(data)
    return (f"spent {spent(data):.4g}" + (f" · held {holding:.4g}" if holding else "")
            + f"{budget} {data.get('currency', '')}").rstrip()


def committed(data: dict[str, Any]) -> float:
    """What the sweep has spent or promised: final bills of ended trials, limits of the rest."""
    return spent(data) + held(data)
