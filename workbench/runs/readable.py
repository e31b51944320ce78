"""How a result dict reads in a notebook: the values a person reads rounded and in units, the
exact values untouched.

:class:`Readable` is a dict (code reads and compares it as any dict); only its display changes:
seconds as ``1h02m`` / ``3m05s`` / ``4.2 s``, other floats to four significant digits, empty
values left out, as a two-column table (HTML) or aligned lines (text). A dict that carries
``price_per_hour`` (``job.summary()``) shows its money through :func:`workbench.runs.money.money`:
'0.42 CNY', or one line 'free' / 'no price set' for a run that bills nothing.
"""

from __future__ import annotations

import html
from typing import Any

from workbench.runs.money import MONEY_KEYS, summary_money


def shown(key: str, value: Any) -> str:
    """``value`` as a person reads it: seconds (keys ending in ``_s``, but not a rate such as
    ``tokens_per_s``) in units, floats rounded."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)) and key.endswith("per_s"):
        return f"{value:,.0f}"  # a rate: whole tokens (or rows) a second
    if isinstance(value, (int, float)) and key.endswith("_s"):
        return _duration(float(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return " - ".join(shown(key, v) for v in value)
    return str(value)


def clock(seconds: int) -> str:
    """Whole seconds as ``1h02m`` (an hour or more) or ``3m05s``: how every view writes a time."""
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else clock(round(s))


class Readable(dict):
    """A dict that displays rounded: ``job.summary()`` in a cell shows a compact table."""

    def shown_items(self) -> list[tuple[str, str]]:
        """(key, text) for every value a person reads, in order; what the views print."""
        with_money = "price_per_hour" in self  # job.summary(): its money as text, or nothing
        money = summary_money(self) if with_money else {}
        hidden = {"currency", "price_per_hour", *MONEY_KEYS} if with_money else set()
        out = []
        for k, v in self.items():
            if k in money:
                out.append((k, money[k]))
            elif k not in hidden and v not in (None, "", [], {}):
                out.append((k, shown(k, v)))
        return out

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        items = self.shown_items()
        width = max((len(k) for k, _ in items), default=0)
        p.text("\n".join(f"{k:<{width}}  {v}" for k, v in items))

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in self.shown_items())
        return f"<table style='font-size:12px'>{rows}</table>"
