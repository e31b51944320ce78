"""SweepView: the live view of one sweep in a notebook.

A trials table (state, parameters, objective, cost), the spend against the budget, the objective
against each parameter (plotly scatter, one panel per parameter), the best trial's loss curve,
and a "compare selected" button: it calls ``workbench.widgets.compare.compare(jobs)`` where that
view exists, else overlays the selected trials' loss curves here. A daemon thread polls the
record every ``interval`` seconds until the sweep ends.
"""

from __future__ import annotations

import html
import importlib
import threading
import time
from typing import Any

import ipywidgets as W

from workbench.sweep import record as rec


def _scatter(df: Any, objective: str, params: list[str]) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=max(1, len(params)), shared_yaxes=True,
                        subplot_titles=params)
    ok = df[df[objective].notna()] if not df.empty else df
    for i, p in enumerate(params, start=1):
        fig.add_trace(go.Scatter(x=ok[p].astype(str) if not ok.empty else [],
                                 y=ok[objective] if not ok.empty else [], mode="markers",
                                 text=[f"trial {t}" for t in ok["trial"]] if not ok.empty else [],
                                 name=p, showlegend=False), row=1, col=i)
    fig.update_yaxes(title_text=objective, row=1, col=1)
    fig.update_layout(height=280, margin={"l": 50, "r": 10, "t": 30, "b": 30})
    return fig


def _curves(jobs: list[Any], title: str) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for job in jobs:
        df = job.metrics_df()
        if not df.empty:
            fig.add_trace(go.Scatter(x=df["step"], y=df["loss"], mode="lines", name=job.id))
    fig.update_layout(title=title, height=280, xaxis_title="step", yaxis_title="loss",
                      margin={"l": 50, "r": 10, "t": 40, "b": 30})
    return fig


class SweepView(W.VBox):
    def __init__(self, sweep: Any, interval: float = 2.0, autostart: bool = True) -> None:
        self.sweep, self.interval = sweep, interval
        self.header, self.table, self.error = W.HTML(), W.HTML(), W.HTML()
        self.scatter, self.best_curve = W.Output(), W.Output()
        self.select = W.SelectMultiple(options=[], description="trials", rows=4)
        self.compare_button = W.Button(description="compare selected", icon="columns")
        self.compare_button.on_click(lambda _b: self.compare())
        self.compared = W.Output()
        self._seen: tuple = ()
        self._stop = threading.Event()
        super().__init__([self.header, self.table, self.scatter, self.best_curve,
                          W.HBox([self.select, self.compare_button]), self.compared, self.error])
        self.refresh()
        if autostart and not self.sweep.done:
            threading.Thread(target=self._loop, daemon=True, name=f"sweep-{sweep.id}").start()

    def refresh(self) -> None:
        data = self.sweep.data()
        df = self.sweep.trials_df()
        self.header.value = (f"<b>{html.escape(self.sweep.id)}</b> · {html.escape(data['state'])}"
                             f" · {data['strategy']} · {html.escape(self.sweep.money(data))}")
        self.table.value = df.drop(columns=["limit"]).to_html(index=False, na_rep="",
                                                              float_format="{:.4g}".format)
        self.select.options = [(f"trial {t['number']}", t["run_id"]) for t in data["trials"]
                               if t.get("run_id")]
        note = data.get("error") or data.get("note")
        self.error.value = f"<pre style='white-space:pre-wrap'>{html.escape(note)}</pre>" \
            if note else ""
        key = tuple((t["number"], t.get("state"), t.get("value")) for t in data["trials"])
        if key == self._seen:
            return
        self._seen = key
        with self.scatter:
            self.scatter.clear_output(wait=True)
            _scatter(df, data["objective"], list(data["space"])).show()
        try:
            best = self.sweep.best
        except Exception:
            return
        with self.best_curve:
            self.best_curve.clear_output(wait=True)
            _curves([best["job"]], f"best: trial {best['trial']} ({best['value']:.4g})").show()

    def compare(self) -> Any:
        """Compare the selected trials: the evaluation work's comparison view when installed."""
        jobs = [j for j in self.sweep.jobs() if j.id in set(self.select.value)]
        try:
            compare = importlib.import_module("workbench.widgets.compare").compare
        except (ModuleNotFoundError, AttributeError):
            compare = None
        with self.compared:
            self.compared.clear_output(wait=True)
            if compare is not None:
                from IPython.display import display

                display(compare(jobs))
            else:
                _curves(jobs, "loss of the selected trials").show()
        return jobs

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # a view must never kill the kernel's thread pool
                self.error.value = f"<pre>view refresh failed: {html.escape(str(exc))}</pre>"
            if self.sweep.state in rec.ENDED:
                self.refresh()
                break
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()
