"""The job view's interactive chart: fed incrementally from a live run, throttled, downsampled."""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.evaluate import results
from workbench.widgets.charts import SeriesChart, downsample, ema
from workbench.widgets.job_view import JobView

REDRAW_S = 0.5


def _lines(job) -> list[dict]:
    """metrics.jsonl read here, independently of the view (event lines are not points)."""
    text = (job.run_dir.path / "metrics.jsonl").read_text()
    return [row for row in map(json.loads, text.splitlines()) if "event" not in row]


@functools.cache
def _launch_pair():
    """Two real 2-process runs that differ only in lr (and name), started together; the first
    is watched by a JobView from launch to end, recording what its chart held at each change.
    The first holds after step 10 (a hold file: HOLD_ENV) until its chart has shown part of the
    curve, so the view sees it mid-run on a machine of any speed.
    Cached so that tests/test_compare.py reuses the same runs."""
    from workbench.train.callbacks import HOLD_ENV

    hold = Path(tempfile.mkdtemp(prefix="wb-hold-")) / "hold"
    hold.write_text("10")
    os.environ[HOLD_ENV] = str(hold)
    try:
        a = workbench.launch({"name": "cmp-a", "train": {"max_steps": 30, "lr": 3e-3}})
    finally:
        os.environ.pop(HOLD_ENV)
    b = workbench.launch({"name": "cmp-b", "train": {"max_steps": 30, "lr": 1e-3}})
    view = JobView(a, interval=0.2, redraw_s=REDRAW_S)
    started = time.monotonic()
    seen: list[tuple[int, int]] = []  # (train points, eval points) after each redraw
    deadline = started + 600
    while time.monotonic() < deadline:
        done = view.finished and not view._thread.is_alive()
        data = view.chart.figure.data
        counts = (len(data[0].x), len(data[2].x))
        if not seen or counts != seen[-1]:
            seen.append(counts)
        if counts[0] > 0 and hold.exists():
            hold.unlink()  # the chart has shown part of the curve: let the run end
        if done:
            break
        time.sleep(0.05)  # polling interval of the watcher, not an assertion's wait
    watched_s = time.monotonic() - started
    hold.unlink(missing_ok=True)  # the view never showed a point: the assertions say so
    hold.parent.rmdir()
    assert a.wait(timeout=600, progress=False) == "succeeded", a.logs(tail=30)
    assert b.wait(timeout=600, progress=False) == "succeeded", b.logs(tail=30)
    return a, b, view, seen, watched_s


@pytest.fixture(scope="module")
def two_runs():
    return _launch_pair()


@pytest.mark.slow
def test_job_view_grows_incrementally_from_a_live_run(two_runs):
    a, _b, view, seen, watched_s = two_runs
    lines = _lines(a)
    train = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "eval_loss" in m]
    data = view.chart.figure.data
    # The end state is every line of metrics.jsonl, once: step by step, value by value.
    assert list(data[0].x) == [m["step"] for m in train] and len(train) == 30
    assert list(data[0].y) == pytest.approx([m["loss"] for m in train])
    assert list(data[2].y) == pytest.approx([m["eval_loss"] for m in evals])
    assert view.chart.sources[0].lines == len(lines)
    # It got there in several redraws while the run was going, never going backwards.
    assert seen[0][0] < 30 and len(seen) >= 3, seen
    assert all(x[0] <= y[0] and x[1] <= y[1] for x, y in zip(seen, seen[1:])), seen
    assert any(0 < n < 30 for n, _ in seen), seen
    # Throttled: no more redraws than the interval allows, however many lines came.
    assert view.chart.redraws <= 2 + watched_s / REDRAW_S, (view.chart.redraws, watched_s)
    assert f"loss <b>{train[-1]['loss']:.4f}</b>" in view.stats.value
    assert "succeeded" in view.header.value and view.cancel_button.disabled
    assert view.cancel_button.layout.display == "none"  # nothing left to cancel: not shown


@pytest.mark.slow
def test_job_view_controls_redraw_by_tokens_time_and_other_series(two_runs):
    a = two_runs[0]
    view = JobView(a, autostart=False)
    chart, lines = view.chart, _lines(a)
    train = [m for m in lines if "loss" in m]
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(chart.metric.options)
    assert chart.metric.options[0] == "loss"
    chart.x_axis.value = "tokens"
    assert list(chart.figure.data[0].x) == [m["tokens"] for m in train]
    assert chart.figure.layout.xaxis.title.text == "tokens seen"
    # An eval line carries no token count: it sits where the train line of its step does.
    first_eval = next(m for m in lines if "eval_loss" in m)
    same_step = next(m for m in train if m["step"] == first_eval["step"])
    assert chart.figure.data[2].x[0] == same_step["tokens"]
    chart.x_axis.value = "time"
    assert chart.figure.data[0].x[0] == pytest.approx(0.0, abs=1e-6)
    assert chart.figure.data[0].x[-1] == pytest.approx(train[-1]["time"] - lines[0]["time"])
    chart.metric.value = "grad_norm"
    assert list(chart.figure.data[0].y) == pytest.approx([m["grad_norm"] for m in train])
    assert len(chart.figure.data[2].x) == 0  # no eval_grad_norm
    chart.log_y.value = True
    assert chart.figure.layout.yaxis.type == "log"
    chart.smoothing.value = 0.0
    assert chart.figure.data[0].visible is False  # raw = smoothed: one line, not two


def test_many_lines_cause_few_redraws_and_long_runs_are_downsampled():
    chart = SeriesChart(["long"], min_redraw_s=REDRAW_S, max_points=1000)
    started, step, pushes = time.monotonic(), 0, 0
    while time.monotonic() - started < 3 * REDRAW_S:
        rows = [{"step": step + i, "time": 1000.0 + step + i, "loss": 1.0 + 1.0 / (step + i + 1)}
                for i in range(50)]
        step += 50
        chart.push(0, rows)
        chart.flush()
        pushes += 1
    elapsed = time.monotonic() - started
    assert pushes > 3 * chart.redraws  # many pushes, few redraws
    assert 2 <= chart.redraws <= 1 + elapsed / REDRAW_S + 1, (chart.redraws, elapsed)
    # A planted spike and the newest point survive downsampling to the point budget.
    chart.push(0, [{"step": step, "time": 0.0, "loss": 50.0},
                   {"step": step + 1, "time": 0.0, "loss": 0.5}])
    assert chart.flush(force=True)
    raw = chart.figure.data[0]
    assert step > 2000, step  # enough lines that the budget matters
    assert len(raw.x) <= 1002 and max(raw.y) == 50.0 and raw.x[-1] == step + 1
    assert not chart.flush(force=True)  # nothing new: nothing sent


def test_smoothing_matches_tensorboards_debiased_ema():
    values = np.array([1.0, 2.0, 4.0, 0.0])
    w = 0.6
    last, expected = 0.0, []
    for i, v in enumerate(values, start=1):  # TensorBoard's loop, written out
        last = last * w + (1 - w) * v
        expected.append(last / (1 - w ** i))
    assert ema(values, w) == pytest.approx(expected)
    assert list(ema(values, 0.0)) == list(values)


def test_downsample_keeps_both_ends_and_extremes_of_each_bucket():
    x = np.arange(10_000, dtype=float)
    y = np.sin(x / 50.0)
    y[1234], y[8765] = 9.0, -9.0
    dx, dy = downsample(x, y, 200)
    assert len(dx) <= 202 and dx[0] == 0 and dx[-1] == 9_999
    assert 9.0 in dy and -9.0 in dy and all(np.diff(dx) > 0)
    assert len(downsample(x[:50], y[:50], 200)[0]) == 50  # short series go through whole


def test_eval_scores_show_in_the_view_as_they_arrive(two_runs):
    b = two_runs[1]
    view = JobView(b, autostart=False)
    assert "judge" not in view.evals.value
    results.append(b.run_dir.path, results.record("judge", {"win_rate": 0.625}, phase="manual",
                                                  step=30, n=16))
    view.refresh()
    assert "judge" in view.evals.value and "win_rate <b>0.625</b>" in view.evals.value
    assert not math.isnan(view.chart.sources[0].last("loss"))


def test_the_chart_opens_on_the_stages_metric_until_the_user_picks_one():
    chart = SeriesChart(["dpo"], opens_on=["rewards/margins"])
    chart.push(0, [{"step": 1, "loss": 0.69}])
    assert chart.metric.value == "loss"  # nothing better logged yet
    chart.push(0, [{"step": 2, "loss": 0.68, "rewards/margins": 0.01}])
    assert chart.metric.value == "rewards/margins"
    chart.metric.value = "loss"  # the user's choice stands from now on
    chart.push(0, [{"step": 3, "loss": 0.6, "rewards/margins": 0.1, "rewards/accuracies": 0.5}])
    assert chart.metric.value == "loss"
