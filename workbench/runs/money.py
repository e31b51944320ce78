"""Money as every view writes it: the plan's headline and summary, ``job.summary()`` in a notebook,
``workbench status`` and the JupyterLab panel all go through :func:`money`.

One rule, so the same run never reads "0.00 CNY" in one place and nothing in another:

- the price is unknown (a GPU run with no price in the spec or the GPU table): ``no price set``;
- the price is zero (a CPU run, whose ``budget.price_per_cpu_core_hour`` defaults to 0): ``free``;
- a priced amount to the cent, ``< 0.01 CNY`` when it is positive but under half a cent, and
  ``0.00 CNY`` only when a priced run has billed nothing yet.

    >>> money(0.4213, "CNY", 2.6), money(0.0, "CNY", 0.0), money(0.0, "CNY", None)
    ('0.42 CNY', 'free', 'no price set')
    >>> money(0.001, "CNY", 2.6), money(0.0, "CNY", 2.6)
    ('< 0.01 CNY', '0.00 CNY')
"""

from __future__ import annotations

from typing import Any

FREE = "free"
NO_PRICE = "no price set"

# job.summary()'s keys that hold an amount of money (a range is a [low, high] pair).
MONEY_KEYS = ("cost", "planned_cost", "projected_cost", "projected_cost_range")


def priced(price_per_hour: float | None) -> bool:
    """Does a run at this price cost anything at all?"""
    return price_per_hour is not None and price_per_hour > 0


def unpriced(price_per_hour: float | None) -> str:
    """What an unpriced run's money reads: 'no price set' (unknown) or 'free' (zero)."""
    return NO_PRICE if price_per_hour is None else FREE


def amount(value: float, currency: str | None) -> str:
    """A priced amount to the cent: '12.30 CNY', '< 0.01 CNY' for a positive amount under half
    a cent (which would round to a 0.00 that reads as free)."""
    text = "< 0.01" if 0 < value < 0.005 else f"{value:,.2f}"
    return f"{text} {currency or ''}".rstrip()


def money(value: float | None, currency: str | None, price_per_hour: float | None) -> str | None:
    """An amount as people read it (module docstring); None when a priced amount is unknown."""
    if not priced(price_per_hour):
        return unpriced(price_per_hour)
    return None if value is None else amount(float(value), currency)


def summary_money(summary: dict[str, Any]) -> dict[str, str]:
    """The money keys of ``job.summary()`` as text, by key (a range as 'low - high'); an unpriced
    run has one entry, ``cost``: 'free' or 'no price set'."""
    price, cur = summary.get("price_per_hour"), summary.get("currency")
    if not priced(price):
        return {"cost": unpriced(price)}
    out = {}
    for key in MONEY_KEYS:
        v = summary.get(key)
        if isinstance(v, (list, tuple)) and len(v) == 2:
            out[key] = f"{amount(float(v[0]), None)} - {amount(float(v[1]), cur)}"
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = amount(float(v), cur)
    return out
