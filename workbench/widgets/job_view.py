"""JobView: a live view of one run — loss curve, throughput, progress, ETA, state, cancel.

A daemon thread polls the run directory (through the Job) and updates the widgets, so the view
keeps moving while the kernel is idle or busy with other cells, and stops once the run has ended.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

import ipywidgets as W

from workbench.rundir import TERMINAL
from workbench.widgets.plots import figure_png, loss_figure

_STATE_COLOURS = {"succeeded": "#2ca02c", "failed": "#d62728", "cancelled": "#7f7f7f",
                  "budget_stopped": "#ff7f0e", "running": "#1f77b4"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class JobView(W.VBox):
    def __init__(self, job: Any, interval: float = 1.0, autostart: bool = True) -> None:
        self.job = job
        self.interval = interval
        self.header = W.HTML()
        self.plot = W.Image(format="png", layout=W.Layout(width="540px"))
        self.stats = W.HTML()
        self.progress = W.IntProgress(min=0, max=1, value=0, layout=W.Layout(width="540px"))
        self.cancel_button = W.Button(description="Cancel run", icon="stop",
                                      button_style="danger", tooltip="Stop every process")
        self.cancel_button.on_click(lambda _b: self._cancel())
        self.error = W.HTML()
        self._n_metrics = -1
        self._stop = threading.Event()
        super().__init__([self.header, self.progress, self.plot, self.stats,
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
        if len(metrics) != self._n_metrics:  # re-render only when there is something new
            self._n_metrics = len(metrics)
            self.plot.value = figure_png(loss_figure(metrics, title="loss"))
        train = [m for m in metrics if "loss" in m]
        evals = [m for m in metrics if "eval_loss" in m]
        speed = train[-1].get("tokens_per_s") if train else None
        prep = status.get("prepare") or {}
        parts = [
            (f"preparing data: {prep.get('split', '')} {prep.get('done', 0):,}/"
             f"{prep.get('total', '?')}" if status.get("phase") == "preparing" else ""),
            f"step <b>{step}</b> / {status.get('total_steps') or '?'}",
            f"loss <b>{train[-1]['loss']:.4f}</b>" if train else "loss –",
            f"eval loss {evals[-1]['eval_loss']:.4f}" if evals else "",
            f"{speed:,.0f} tokens/s" if speed else "",
            f"elapsed {_duration(status.get('elapsed_s'))}",
            (f"cost {status['cost']:.2f} {status.get('currency', '')}"
             if status.get("cost") is not None else ""),
            (f"projected {status['projected_cost']:.2f} {status.get('currency', '')}"
             if status.get("projected_cost") is not None and state not in TERMINAL else ""),
            (f"snapshot {status['snapshot']['path']}" if status.get("snapshot") else ""),
            (f"upload {status['upload']['state']}" if status.get("upload") else ""),
            (f"restarts {status['restarts']}" if status.get("restarts") else ""),
            f"ETA {_duration(status.get('eta_s'))}" if state not in TERMINAL else "",
        ]
        self.stats.value = " &nbsp;·&nbsp; ".join(p for p in parts if p)
        self.cancel_button.disabled = state in TERMINAL
        err, note = status.get("error"), status.get("note")  # note: why a run stopped short
        if not note and state not in TERMINAL:
            note = status.get("budget_warning")  # the projection passes the limit: say so early
        text, colour = (err, "#d62728") if err else (note, _STATE_COLOURS["budget_stopped"])
        self.error.value = (f"<pre style='color:{colour};white-space:pre-wrap'>"
                            f"{html.escape(text)}</pre>") if text else ""
        return status

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
