"""JobView: a live view of one run — interactive metric chart, eval scores, throughput,
progress, ETA, state, cancel.

A daemon thread polls the run directory (through the Job) and updates the widgets, so the view
keeps moving while the kernel is idle or busy with other cells, and stops once the run has ended.
Each poll hands the chart only the metrics lines that are new since the last one; the chart
redraws at most every ``redraw_s`` seconds (see :mod:`workbench.widgets.charts`). Scores from
``eval.jsonl`` are re-read only when the file has grown.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

import ipywidgets as W

from workbench.evaluate import results
from workbench.runs.money import money, priced, unpriced
from workbench.runs.readable import clock
from workbench.runs.rundir import TERMINAL
from workbench.widgets.charts import SeriesChart

_STATE_COLOURS = {"succeeded": "#2ca02c", "failed": "#d62728", "cancelled": "#7f7f7f",
                  "budget_stopped": "#ff7f0e", "running": "#1f77b4",
                  "pruned": "#9467bd"}  # a sweep stopped it: clearly worse, not failed


def _duration(seconds: float | None) -> str:
    return "–" if seconds is None else clock(int(seconds))


def eval_table(lines: list[dict[str, Any]], limit: int = 20) -> str:
    """The newest ``limit`` eval.jsonl lines as a small HTML table (one row per task and point)."""
    if not lines:
        return ""
    head = "".join(f"<th style='text-align:left'>{h}</th>"
                   for h in ("phase", "step", "model", "task", "scores", "n"))
    rows = []
    for ln in lines[-limit:]:
        scores = ", ".join(f"{html.escape(k)} <b>{v:.4g}</b>" for k, v in ln["metrics"].items())
        cells = (html.escape(str(ln.get("phase", ""))), str(ln.get("step", "")),
                 html.escape(str(ln.get("model", ""))), html.escape(str(ln.get("task", ""))),
                 scores, str(ln.get("n", "")))
        rows.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells)
                    + "</tr>")
    return (f"<b>evaluations</b><table style='font-size:12px'><tr>{head}</tr>{''.join(rows)}"
            "</table>")


# What shows a stage learning, logged by TRL (loss means little there: GRPO's is about 0).
OPENS_ON = {"dpo": ("rewards/margins",), "orpo": ("rewards/margins",),
            "kto": ("rewards/margins", "kl"), "grpo": ("reward",)}


def _opens_on(job: Any) -> tuple[str, ...]:
    try:
        return OPENS_ON.get(job.spec.method.stage, ())
    except Exception:  # noqa: BLE001 - no readable spec (a course job's view): loss, as ever
        return ()


class JobView(W.VBox):
    def __init__(self, job: Any, interval: float | None = None, autostart: bool = True,
                 redraw_s: float = 0.5) -> None:
        self.job = job
        # A local run's files are read in place: twice a second keeps a step on screen within
        # a second (bench/bench_train.py --latency-only). A remote run's refresh is two SSH
        # round trips, so it asks less often.
        remote = getattr(getattr(job, "backend", None), "sync", None) is not None
        self.interval = interval if interval is not None else (2.0 if remote else 0.5)
        self.header = W.HTML()
        self.chart = SeriesChart([job.id], min_redraw_s=redraw_s, opens_on=_opens_on(job))
        self.evals = W.HTML()
        self.stats = W.HTML()
        self.progress = W.IntProgress(min=0, max=1, value=0, layout=W.Layout(width="540px"))
        self.cancel_button = W.Button(description="Cancel run", icon="stop",
                                      button_style="danger", tooltip="Stop every process")
        self.cancel_button.on_click(lambda _b: self._cancel())
        self.error = W.HTML()
        self._seen = 0  # metrics lines already handed to the chart
        self._plan: dict[str, Any] = {}  # plan.json's total time and cost, read once it exists
        self._last_row: dict[str, Any] | None = None
        self._eval_size = -1
        self._stop = threading.Event()
        super().__init__([self.header, self.progress, self.chart, self.stats, self.evals,
                          self.cancel_button, self.error])
        self.refresh()
        if autostart and not self.finished:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=f"view-{job.id}")
            self._thread.start()

    finished = property(lambda self: self._last_state in TERMINAL)

    def refresh(self) -> dict[str, Any]:
        status = self.job.status()
        metrics = self.job.metrics()
        state = status.get("state", "pending")
        self._last_state = state
        colour = _STATE_COLOURS.get(state, "#333")
        self.header.value = (f"<b>{html.escape(self.job.id)}</b> &nbsp;"
                             f"<span style='color:{colour}'>● {html.escape(state)}</span>"
                             f" &nbsp;<small>{html.escape(self.job.target)}</small>")
        total, step = status.get("total_steps") or 1, status.get("step") or 0
        self.progress.max, self.progress.value = total, min(step, total)
        self._push(metrics)
        self.chart.flush(force=state in TERMINAL)
        self._read_evals()
        src = self.chart.sources[0]
        loss, eval_loss, speed = src.last("loss"), src.last("eval_loss"), src.last("tokens_per_s")
        prep = status.get("prepare") or {}
        if not self._plan:  # plan.json is written once, at launch
            self._plan = {k: v for k, v in getattr(self.job, "planned", dict)().items()
                          if v is not None or k == "price_per_hour"}  # None: no price known
        planned = self._plan
        parts = [
            (f"preparing data: {prep.get('split', '')} {prep.get('done', 0):,}/"
             f"{prep.get('total', '?')}" if status.get("phase") == "preparing" else ""),
            (f"waiting: {html.escape(str(status['queue_reason']))}" if status.get("queue_reason")
             else ""),  # why Slurm holds it in the queue
            f"step <b>{step}</b> / {status.get('total_steps') or '?'}",
            f"loss <b>{loss:.4f}</b>" if loss is not None else "loss –",
            f"eval loss {eval_loss:.4f}" if eval_loss is not None else "",
            f"{speed:,.0f} tokens/s" if speed else "",
            f"elapsed {_duration(status.get('elapsed_s'))}",
            _cost(status, planned),
            (f"projected {_duration(status['projected_total_s'])}"
             + _projected_cost(status, planned)
             + _vs_plan(planned) if status.get("projected_total_s") is not None
             and state not in TERMINAL else ""),
            (f"snapshot {status['snapshot']['path']}" if status.get("snapshot") else ""),
            (f"upload {status['upload']['state']}" if status.get("upload") else ""),
            (f"restarts {status['restarts']}" if status.get("restarts") else ""),
            f"ETA {_duration(status.get('eta_s'))}" if state not in TERMINAL else "",
        ]
        self.stats.value = " &nbsp;·&nbsp; ".join(p for p in parts if p)
        # An ended run has nothing to cancel: the button goes (the header says how it ended).
        self.cancel_button.disabled = state in TERMINAL
        self.cancel_button.layout.display = "none" if state in TERMINAL else None
        err, note = status.get("error"), status.get("note")  # note: why a run stopped short
        if not note and state not in TERMINAL:
            note = status.get("budget_warning")  # the projection passes the limit: say so early
        text, colour = (err, "#d62728") if err else (note, _STATE_COLOURS["budget_stopped"])
        self.error.value = (f"<pre style='color:{colour};white-space:pre-wrap'>"
                            f"{html.escape(text)}</pre>") if text else ""
        return status

    def _push(self, metrics: list[dict[str, Any]]) -> None:
        """Hand the chart the lines it has not seen; start over if a resume rewrote the tail."""
        seen = self._seen
        if seen and (len(metrics) < seen or metrics[seen - 1] is not self._last_row):
            self.chart.reset(0)
            seen = 0
        if len(metrics) > seen:
            self.chart.push(0, metrics[seen:])
            self._seen, self._last_row = len(metrics), metrics[-1]

    def _read_evals(self) -> None:
        path = self.job.run_dir.path / results.FILE
        size = path.stat().st_size if path.is_file() else 0
        if size != self._eval_size:
            self._eval_size = size
            self.evals.value = eval_table(results.read(self.job.run_dir.path))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # a view must never kill the kernel's thread pool
                self.error.value = f"<pre>view refresh failed: {html.escape(str(exc))}</pre>"
            if self.finished:
                break
            time.sleep(self.interval)

    def _cancel(self) -> None:
        self.cancel_button.disabled = True
        self.cancel_button.description = "Cancelling…"
        threading.Thread(target=self._do_cancel, daemon=True).start()

    def _do_cancel(self) -> None:
        self.job.cancel()
        self.cancel_button.description = "Cancelled"
        self.refresh()

    def stop(self) -> None:
        self._stop.set()


def _price(status: dict[str, Any], planned: dict[str, Any]) -> float | None:
    """The plan's price per unit-hour (None: unknown, 0: free), else the supervisor's."""
    return planned["price_per_hour"] if "price_per_hour" in planned else status.get("price_per_hour")


def _cost(status: dict[str, Any], planned: dict[str, Any]) -> str:
    """'cost 0.42 CNY', 'cost: free', 'cost: no price set' (workbench.runs.money's one rule)."""
    price = _price(status, planned)
    if not priced(price):
        return f"cost: {unpriced(price)}" if status.get("cost") is not None else ""
    text = money(status.get("cost"), status.get("currency"), price)
    return f"cost {text}" if text else ""


def _projected_cost(status: dict[str, Any], planned: dict[str, Any]) -> str:
    """', 0.61 CNY' after the projected time; nothing for a run that bills nothing."""
    price = _price(status, planned)
    if not priced(price) or status.get("projected_cost") is None:
        return ""
    return f", {money(status['projected_cost'], status.get('currency'), price)}"


def _vs_plan(planned: dict[str, Any]) -> str:
    """' (plan 4m00s, 0.05 CNY)': the plan's figures beside the live projection."""
    parts = [_duration(planned["planned_total_s"])] if planned.get("planned_total_s") else []
    if planned.get("planned_cost") is not None and priced(planned.get("price_per_hour")):
        parts.append(str(money(planned["planned_cost"], planned.get("currency"),
                               planned["price_per_hour"])))
    return f" (plan {', '.join(parts)})" if parts else ""
