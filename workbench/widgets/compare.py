"""Compare runs: overlaid curves, a table of losses, eval scores and spec differences, answers.

``compare_df(runs)`` is the table (headless; the CLI prints it): one row per run with its final
and best losses, the newest eval.jsonl scores of the tuned model (``eval:TASK.METRIC``) and of the
base model (``base:TASK.METRIC``), and every RunSpec key whose value differs between the runs
(``spec:train.lr``). ``compare(runs)`` is the widget: the same table with the differences
highlighted, every run's curves overlaid in one :class:`~workbench.widgets.charts.SeriesChart`,
and the same prompts answered side by side (:mod:`workbench.widgets.answers`).

    >>> workbench.compare(["lr-3e-3", "lr-1e-3"])                 # doctest: +SKIP
    >>> compare_df(["lr-3e-3", "lr-1e-3"])[["final loss"]]        # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from typing import Any

import ipywidgets as W

from workbench.errors import WorkbenchError
from workbench.evaluate import results
from workbench.widgets.charts import SeriesChart, static_figure

SPEC, EVAL, BASE = "spec:", "eval:", "base:"  # column prefixes of compare_df


class CompareError(WorkbenchError, ValueError):
    """The runs given to compare cannot be compared (too few, or not runs)."""


def resolve_runs(runs: Any) -> list[Any]:
    """Jobs for ``runs`` (Jobs, ids or names), at least two distinct ones."""
    from workbench.runs.jobs import Job, get_job

    if isinstance(runs, (str, Job)) or not isinstance(runs, Sequence):
        runs = [runs]
    jobs: list[Any] = []
    for run in runs:
        if isinstance(run, Job):
            jobs.append(run)
        elif isinstance(run, str):
            jobs.append(get_job(run))  # RunNotFoundError names the id and how to list runs
        else:
            raise CompareError(f"compare takes Jobs, run ids or run names; got {run!r} "
                               f"({type(run).__name__})")
    ids = [j.id for j in jobs]
    if len(set(ids)) < 2:
        raise CompareError(f"compare needs at least two different runs; got {ids}. Pass a list, "
                           "e.g. workbench.compare(['run-a', 'run-b']) (`workbench status` "
                           "lists the runs); job.show() views a single one")
    return jobs


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: json.dumps(value) if isinstance(value, list) else value}


def spec_diff(jobs: Sequence[Any]) -> dict[str, list[Any]]:
    """Flattened RunSpec keys whose values differ between the runs (None where a run lacks one)."""
    flat = [_flatten(job.spec.model_dump(mode="json")) for job in jobs]
    keys = sorted(set().union(*flat))
    return {k: [f.get(k) for f in flat] for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1}


def _losses(rows: list[dict[str, Any]]) -> dict[str, Any]:
    train = [m for m in rows if "loss" in m and "event" not in m]
    evals = [m for m in rows if "eval_loss" in m and "event" not in m]
    best = min(train, key=lambda m: m["loss"]) if train else None
    return {
        "steps": train[-1]["step"] if train else None,
        "tokens": next((m["tokens"] for m in reversed(train) if "tokens" in m), None),
        "final loss": train[-1]["loss"] if train else None,
        "best loss": best["loss"] if best else None,
        "best step": best["step"] if best else None,
        "final eval_loss": evals[-1]["eval_loss"] if evals else None,
        "best eval_loss": min(m["eval_loss"] for m in evals) if evals else None,
    }


def _row(job: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    lines = results.read(job.run_dir.path)
    row: dict[str, Any] = {"run": job.id, "name": job.name, "state": job.state, **_losses(rows)}
    row.update({EVAL + k: v for k, v in results.flat(
        [ln for ln in lines if ln.get("model") != "base"]).items()})
    row.update({BASE + k: v for k, v in results.flat(
        [ln for ln in lines if ln.get("model") == "base"]).items()})
    return row


def compare_df(runs: Any) -> Any:
    """One row per run (index: run id): losses, eval scores, and the spec keys that differ.

    A run with no metrics yet has empty (NaN) losses and its state says why.
    """
    import pandas as pd

    jobs = resolve_runs(runs)
    rows = [_row(job, job.metrics()) for job in jobs]
    for key, values in spec_diff(jobs).items():
        for row, value in zip(rows, values):
            row[SPEC + key] = value
    df = pd.DataFrame(rows).set_index("run")
    fixed = [c for c in df.columns if not c.startswith((EVAL, BASE, SPEC))]
    scores = sorted(c for c in df.columns if c.startswith((EVAL, BASE)))
    return df[fixed + scores + sorted(c for c in df.columns if c.startswith(SPEC))]


def compare_table(df: Any) -> str:
    """The compare_df table as text, one run per row (what the CLI prints)."""
    shown = df.drop(columns=["best step"], errors="ignore").reset_index()
    cells = [[str(c) for c in shown.columns]]
    for _, r in shown.iterrows():
        cells.append([_fmt(v) for v in r])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def compare_figure(runs: Any, metric: str = "loss", smoothing: float = 0.0) -> Any:
    """Every run's ``metric`` by step and by tokens in one static plotly Figure (HTML export)."""
    jobs = resolve_runs(runs)
    return static_figure([j.id for j in jobs], [j.metrics() for j in jobs], metric, smoothing)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _lower_is_better(column: str) -> bool:
    return "loss" in column or "perplexity" in column


def table_html(df: Any) -> str:
    """compare_df as HTML: spec differences on a yellow ground, the best score of a column bold."""
    head = "".join(f"<th style='text-align:left;{_shade(c)}'>{html.escape(str(c))}</th>"
                   for c in ["run", *df.columns])
    best: dict[str, Any] = {}
    for c in df.columns:
        if not c.startswith(SPEC) and c not in ("steps", "tokens", "best step", "state", "name"):
            values = [v for v in df[c] if isinstance(v, (int, float)) and not math.isnan(v)]
            if len(values) > 1:
                best[c] = min(values) if _lower_is_better(c) else max(values)
    body = []
    for run, r in df.iterrows():
        tds = [f"<td style='text-align:left'><code>{html.escape(str(run))}</code></td>"]
        for c in df.columns:
            text = html.escape(_fmt(r[c]))
            if c in best and r[c] == best[c]:
                text = f"<b>{text}</b>"
            tds.append(f"<td style='text-align:left;{_shade(c)}'>{text}</td>")
        body.append(f"<tr>{''.join(tds)}</tr>")
    return (f"<table style='font-size:12px'><tr>{head}</tr>{''.join(body)}</table>"
            "<small>yellow: spec keys that differ between the runs; bold: the best value</small>")


def _shade(column: str) -> str:
    return "background:#fff3bf" if str(column).startswith(SPEC) else ""


class CompareView(W.VBox):
    """Overlaid curves, the comparison table and answers side by side, for two runs or more."""

    def __init__(self, runs: Any) -> None:
        from workbench.widgets.answers import AnswersView

        self.jobs = resolve_runs(runs)
        self.chart = SeriesChart([j.id for j in self.jobs], smoothing=0.0, min_redraw_s=0.0,
                                 title="")
        self.table = W.HTML()
        self.message = W.HTML()
        self.refresh_button = W.Button(description="Refresh", icon="refresh",
                                       tooltip="read new metrics and scores")
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.answers = AnswersView(self.jobs)
        super().__init__([W.HTML(f"<b>Comparing {len(self.jobs)} runs</b>"), self.chart,
                          self.message, self.table, self.refresh_button, self.answers])
        self.refresh()

    def refresh(self) -> Any:
        """Re-read every run's metrics and scores; returns the table (a DataFrame)."""
        empty = []
        for i, job in enumerate(self.jobs):
            self.chart.reset(i)
            rows = job.metrics()
            self.chart.push(i, rows)
            if not any("loss" in m for m in rows):
                empty.append(f"{job.id} ({job.state})")
        self.chart.flush(force=True)
        self.df = compare_df(self.jobs)
        self.table.value = table_html(self.df)
        self.message.value = (f"<span style='color:#ff7f0e'>no metrics yet: "
                              f"{html.escape(', '.join(empty))}</span>") if empty else ""
        return self.df


def compare(runs: Any) -> CompareView:
    """One widget comparing runs (Jobs, ids or names): curves, table, answers side by side."""
    return CompareView(runs)
