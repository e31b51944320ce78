"""Interactive metric charts (plotly): the live chart of the job view and the overlay of compare.

A :class:`SeriesChart` holds the metrics lines of one or more runs, column by column, and draws one
metric of each against step, tokens or elapsed time, with TensorBoard's debiased EMA smoothing, a
log-scale toggle and hover values. New lines arrive through :meth:`SeriesChart.push` (only the new
ones: nothing is re-parsed); :meth:`SeriesChart.flush` redraws at most once per ``min_redraw_s`` in
one ``batch_update`` and sends at most ``max_points`` points per trace (min/max per bucket, so
spikes survive), so a run of a million steps costs the browser what a short one does.
:func:`static_figure` draws the same traces into a plain ``go.Figure`` for HTML export.

    >>> chart = SeriesChart(["run-a"])                          # doctest: +SKIP
    >>> chart.push(0, job.metrics()); chart.flush(force=True)   # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as W
import numpy as np

X_AXES = {"step": "step", "tokens": "tokens seen", "time": "elapsed (s)"}
_NOT_SERIES = {"step", "time", "tokens", "epoch", "event"}  # axes and bookkeeping, not metrics
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")


@dataclass
class _Column:
    step: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    value: list[float] = field(default_factory=list)


@dataclass
class _Source:
    """One run's metrics as columns, grown line by line."""

    label: str
    columns: dict[str, _Column] = field(default_factory=dict)
    t0: float | None = None
    lines: int = 0

    def add(self, rows: Iterable[dict[str, Any]]) -> set[str]:
        new_keys: set[str] = set()
        for row in rows:
            if "event" in row or "step" not in row:
                continue  # snapshot / resume markers are not points
            self.lines += 1
            t = float(row.get("time", math.nan))
            if self.t0 is None and not math.isnan(t):
                self.t0 = t
            tokens = row.get("tokens")
            for key, value in row.items():
                if key in _NOT_SERIES or isinstance(value, bool) or not isinstance(
                        value, (int, float)):
                    continue
                col = self.columns.get(key)
                if col is None:
                    col = self.columns[key] = _Column()
                    new_keys.add(key)
                col.step.append(float(row["step"]))
                col.time.append(t)
                col.tokens.append(float(tokens) if isinstance(tokens, (int, float)) else math.nan)
                col.value.append(float(value))
        return new_keys

    def last(self, key: str) -> float | None:
        col = self.columns.get(key)
        return col.value[-1] if col and col.value else None

    def xs(self, col: _Column, axis: str) -> np.ndarray:
        if axis == "time":
            return np.asarray(col.time) - (self.t0 or 0.0)
        if axis == "tokens":
            tokens = np.asarray(col.tokens)
            missing = np.isnan(tokens)
            known = self._token_map()
            if missing.any() and known is not None:  # eval lines carry no count: place by step
                tokens[missing] = np.interp(np.asarray(col.step)[missing], *known)
            return tokens
        return np.asarray(col.step)

    def _token_map(self) -> tuple[np.ndarray, np.ndarray] | None:
        for col in self.columns.values():
            tok = np.asarray(col.tokens)
            ok = ~np.isnan(tok)
            if ok.any():
                return np.asarray(col.step)[ok], tok[ok]
        return None


def series_names(keys: Iterable[str]) -> list[str]:
    """Dropdown entries: each metric once (``eval_x`` rides along with ``x``), loss first."""
    keys = set(keys)
    names = {k for k in keys if not (k.startswith("eval_") and k[5:] in keys)}
    return sorted(names, key=lambda k: (k != "loss", k))


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average debiased for its start."""
    if weight <= 0 or len(values) == 0:
        return values
    import pandas as pd

    # adjust=True divides by the sum of the weights seen so far: TensorBoard's debiasing.
    return pd.Series(values).ewm(alpha=1.0 - weight, adjust=True, ignore_na=True).mean().to_numpy()


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ~max_points points: the min and max of each bucket, plus both ends."""
    n = len(x)
    if n <= max_points:
        return x, y
    buckets = max(1, max_points // 2)
    size = math.ceil(n / buckets)
    padded = np.full(buckets * size, np.nan)
    padded[:n] = y
    grid = padded.reshape(buckets, size)
    lo = np.argmin(np.where(np.isnan(grid), np.inf, grid), axis=1)
    hi = np.argmax(np.where(np.isnan(grid), -np.inf, grid), axis=1)
    base = np.arange(buckets) * size
    keep = np.unique(np.concatenate([base + lo, base + hi, [0, n - 1]]))
    keep = keep[keep < n]
    return x[keep], y[keep]


def _traces(src: _Source, metric: str, axis: str, smoothing: float,
            max_points: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(raw, smoothed, eval) x/y arrays of one source; empty arrays where there is nothing."""
    empty = (np.empty(0), np.empty(0))
    train, evals = src.columns.get(metric), src.columns.get(f"eval_{metric}")
    if metric.startswith("eval_"):  # listed alone only when there is no train series to pair
        train, evals = None, src.columns.get(metric)
    raw = smooth = ev = empty
    if train is not None:
        x, y = src.xs(train, axis), np.asarray(train.value)
        ok = ~np.isnan(x)
        x, y = x[ok], y[ok]
        raw = downsample(x, y, max_points)
        smooth = downsample(x, ema(y, smoothing), max_points)
    if evals is not None:
        x, y = src.xs(evals, axis), np.asarray(evals.value)
        ok = ~np.isnan(x)
        ev = downsample(x[ok], y[ok], max_points)
    return raw, smooth, ev


def _trace_names(label: str, metric: str, single: bool) -> tuple[str, str, str]:
    base = metric[5:] if metric.startswith("eval_") else metric
    if single:
        return f"train {base} (raw)", f"train {base}", f"eval {base}"
    return f"{label} (raw)", label, f"{label} eval"


class SeriesChart(W.VBox):
    """Controls (metric, x axis, smoothing, log scale) over one FigureWidget, several runs.

    Three traces per run: raw (faint, shown when smoothing is on), smoothed, and eval.
    ``redraws`` counts the batch updates sent to the browser.
    """

    def __init__(self, labels: Sequence[str], *, smoothing: float = 0.6, min_redraw_s: float = 1.5,
                 max_points: int = 2000, title: str = "", height: int = 320,
                 opens_on: Sequence[str] = ()) -> None:
        """``opens_on``: the metrics to show first, best first (a DPO run's reward margin), as
        soon as one appears and until the user picks one; loss otherwise."""
        import plotly.graph_objects as go

        self.sources = [_Source(label) for label in labels]
        self.min_redraw_s = min_redraw_s
        self.max_points = max_points
        self.redraws = 0
        self._dirty = False
        self._last_draw = -math.inf
        self.opens_on = list(opens_on)
        self._picked = False  # the user chose a metric: the chart no longer picks one
        self._setting = False  # the chart itself is changing the choice
        self.metric = W.Dropdown(options=["loss"], value="loss", description="metric",
                                 layout=W.Layout(width="240px"))
        self.metric.observe(self._user_pick, names="value")
        self.x_axis = W.ToggleButtons(options=list(X_AXES), value="step",
                                      style={"button_width": "64px"}, tooltips=list(X_AXES.values()))
        self.smoothing = W.FloatSlider(smoothing, min=0.0, max=0.99, step=0.01,
                                       description="smoothing", readout_format=".2f")
        self.log_y = W.Checkbox(False, description="log y", indent=False,
                                layout=W.Layout(width="80px"))
        single = len(self.sources) == 1
        self.figure = go.FigureWidget()
        for i, src in enumerate(self.sources):
            colour = PALETTE[i % len(PALETTE)]
            raw_name, smooth_name, eval_name = _trace_names(src.label, "loss", single)
            self.figure.add_scatter(x=[], y=[], name=raw_name, mode="lines", opacity=0.25,
                                    line={"color": colour, "width": 1}, showlegend=False,
                                    hoverinfo="skip", legendgroup=src.label)
            self.figure.add_scatter(x=[], y=[], name=smooth_name, mode="lines",
                                    line={"color": colour, "width": 2}, legendgroup=src.label)
            self.figure.add_scatter(x=[], y=[], name=eval_name, mode="lines+markers",
                                    line={"color": colour if not single else PALETTE[1],
                                          "dash": "dash"}, marker={"size": 6},
                                    legendgroup=src.label)
        self.figure.update_layout(height=height, width=680, title=title or None,
                                  margin={"l": 50, "r": 10, "t": 30 if title else 10, "b": 40},
                                  hovermode="x unified", xaxis_title="step", yaxis_title="loss",
                                  legend={"orientation": "h", "y": -0.25})
        for w in (self.metric, self.x_axis, self.smoothing, self.log_y):
            w.observe(lambda _c: self.draw(), names="value")
        super().__init__([W.HBox([self.metric, self.x_axis]), W.HBox([self.smoothing, self.log_y]),
                          self.figure])

    def push(self, index: int, rows: Iterable[dict[str, Any]]) -> None:
        """Add new metrics lines of run ``index`` (drawn at the next :meth:`flush`)."""
        new = self.sources[index].add(rows)
        self._dirty = True
        if new:
            keys = {k for s in self.sources for k in s.columns}
            options = series_names(keys)
            if list(self.metric.options) != options:
                current = self.metric.value
                if not self._picked:
                    current = next((m for m in self.opens_on if m in options), current)
                self._setting = True
                try:  # the options first: the new value must be one of them
                    self.metric.options = options
                    self.metric.value = current if current in options else options[0]
                finally:
                    self._setting = False

    def _user_pick(self, change: dict[str, Any]) -> None:
        if not self._setting:
            self._picked = True

    def reset(self, index: int) -> None:
        """Forget run ``index``'s lines (a resumed run rewrote its tail)."""
        self.sources[index] = _Source(self.sources[index].label)
        self._dirty = True

    def flush(self, force: bool = False) -> bool:
        """Redraw if something new arrived and the last redraw is ``min_redraw_s`` old."""
        if not self._dirty or (not force and
                               time.monotonic() - self._last_draw < self.min_redraw_s):
            return False
        self.draw()
        return True

    def draw(self) -> None:
        metric, axis = self.metric.value, self.x_axis.value
        weight = float(self.smoothing.value)
        single = len(self.sources) == 1
        with self.figure.batch_update():
            for i, src in enumerate(self.sources):
                raw, smooth, ev = _traces(src, metric, axis, weight, self.max_points)
                traces = self.figure.data[3 * i:3 * i + 3]
                for trace, (x, y), name in zip(traces, (raw, smooth, ev),
                                               _trace_names(src.label, metric, single)):
                    trace.x, trace.y, trace.name = x, y, name
                traces[0].visible = weight > 0
            self.figure.layout.xaxis.title.text = X_AXES[axis]
            self.figure.layout.yaxis.title.text = metric
            self.figure.layout.yaxis.type = "log" if self.log_y.value else "linear"
        self._dirty = False
        self._last_draw = time.monotonic()
        self.redraws += 1


def static_figure(labels: Sequence[str], metrics: Sequence[list[dict[str, Any]]],
                  metric: str = "loss", smoothing: float = 0.0, max_points: int = 5000) -> Any:
    """``metric`` of each run by step and by tokens, side by side: a plain ``go.Figure``."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"{metric} by step", f"{metric} by tokens"))
    for i, (label, rows) in enumerate(zip(labels, metrics)):
        src = _Source(label)
        src.add(rows)
        colour = PALETTE[i % len(PALETTE)]
        for col, axis in ((1, "step"), (2, "tokens")):
            _raw, (x, y), (ex, ey) = _traces(src, metric, axis, smoothing, max_points)
            fig.add_scatter(x=x, y=y, name=label, mode="lines", line={"color": colour},
                            legendgroup=label, showlegend=col == 1, row=1, col=col)
            if len(ex):
                fig.add_scatter(x=ex, y=ey, name=f"{label} eval", mode="lines+markers",
                                line={"color": colour, "dash": "dash"}, legendgroup=label,
                                showlegend=col == 1, row=1, col=col)
        fig.update_xaxes(title_text=X_AXES["step"], row=1, col=1)
        fig.update_xaxes(title_text=X_AXES["tokens"], row=1, col=2)
    fig.update_layout(hovermode="x unified", height=420, yaxis_title=metric)
    return fig
