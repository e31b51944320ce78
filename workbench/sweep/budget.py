"""The sweep's one budget: what it has spent (the final bills of its ended trials), what it holds
(the whole ``budget.limit`` of every trial under way) and what a trial is priced at before it
starts (the planner's cost with a margin, plus starting and releasing its processes).

A run never passes its own limit, so a trial that starts only when its price fits in what is
neither spent nor held keeps the sum of the trials' costs under the sweep's limit.
"""

from __future__ import annotations

import os
from typing import Any

from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, hourly_price
from workbench.spec import RunSpec
from workbench.sweep import record as rec

# The planner's price of a trial is an estimate (start-up on a busy machine is not in it): a trial
# starts only when this multiple of it, plus starting and releasing, fits in what is left.
PRICE_MARGIN = 1.5
# The share of its cores a CPU run alone keeps busy (/proc/stat while a 2-process run of the tiny
# model trains on 2 cores: 136-179 of every 200 core-ticks busy).
BUSY = 0.8


def sharing(spec: RunSpec, at_once: int) -> float:
    """How many times longer a trial holds its processes because ``at_once`` trials run on this
    machine's CPU cores together (1: no slower).

    The planner times a run alone. Once the trials' processes outnumber the cores, they take
    turns on them, start-up and steps alike; a run alone keeps its cores BUSY of the time (it
    also waits on its disk and its ranks on each other), which the others' turns fill first.
    Measured on 2 cores, two 2-process trials of the tiny model held 1.5-2.0 times as long as
    the same run alone minutes before (median 1.8; 1.15 and 3.1 once each, as the host's own
    speed came and went). Trials on GPUs, or on other targets, share no cores here.
    """
    r = spec.resources
    if at_once <= 1 or spec.target != "local" or r.gpus_per_node != 0:
        return 1.0
    cores, procs = os.cpu_count() or 1, r.world_size
    share = at_once * procs / max(cores, procs)  # alone, a trial has its own cores
    return max(1.0, 1.0 + (share - 1.0) * BUSY)


def trial_price(spec: RunSpec, at_once: int = 1) -> tuple[float | None, float]:
    """The planner's cost of a trial of ``spec``, slowed by the ``at_once`` trials it runs
    beside (:func:`sharing`), and what the controller sets aside before it starts one: that
    cost times PRICE_MARGIN, plus starting and releasing its processes."""
    from workbench.plan import plan

    planned = plan(spec).cost
    if planned is not None:
        planned *= sharing(spec, at_once)
    per_hour, _ = hourly_price(spec)
    return planned, (planned or 0.0) * PRICE_MARGIN + per_hour * (KILL_GRACE_S + RELEASE_S) / 3600.0


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
