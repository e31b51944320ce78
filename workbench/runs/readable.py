"""How a result dict reads in a notebook: the values a person reads rounded and in units, the
exact values untouched.

:class:`Readable` is a dict (code reads and compares it as any dict); only its display changes:
seconds as ``1h02m`` / ``3m05s`` / ``4.2 s``, other floats to four significant digits, empty
values left out, as a two-column table (HTML) or aligned lines (text).
"""

from __future__ import annotations

import html
from typing import Any


def shown(key: str, value: Any) -> str:
    """``value`` as a person reads it: seconds (keys ending in ``_s``) in units, floats rounded."""
    if isinstance(value, bool) or value is None:
        return str(value)
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

    def _items(self) -> list[tuple[str, str]]:
        return [(k, shown(k, v)) for k, v in self.items() if v not in (None, "", [], {})]

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        items = self._items()
        width = max((len(k) for k, _ in items), default=0)
        p.text("\n".join(f"{k:<{width}}  {v}" for k, v in items))

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in self._items())
        return f"<table style='font-size:12px'>{rows}</table>"
