"""The sweep's one budget: what it has spent (the final bills of its ended trials), what it holds
(the whole ``budget.limit`` of every trial under way) and what a trial is priced at before it
starts (the planner's cost with a margin, plus starting and releasing its processes).

A run never passes its own limit, so a trial that starts only when its price fits in what is
neither spent nor held keeps the sum of the trials' costs under the sweep's limit.
"""

from __future__ import annotations

from typing import Any

from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, hourly_price
from workbench.spec import RunSpec
from workbench.sweep import record as rec

# The planner's price of a trial is an estimate (start-up on a busy machine is not in it): a trial
# starts only when this multiple of it, plus starting and releasing, fits in what is left.
PRICE_MARGIN = 1.5


def trial_price(spec: RunSpec) -> tuple[float | None, float]:
    """The planner's cost of a trial of ``spec``, and what the controller sets aside before it
    starts one: that cost times PRICE_MARGIN, plus starting and releasing its processes."""
    from workbench.plan import plan

    planned = plan(spec).cost
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
