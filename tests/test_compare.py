"""workbench.compare / compare_df / `workbench compare`: two real runs that differ in lr."""

from __future__ import annotations

import json
import math
import time

import pandas as pd
import pytest

import workbench
from workbench.cli import main
from workbench.errors import RunNotFoundError, WorkbenchError
from workbench.evaluate import results
from workbench.runs.registry import Registry, RunRecord
from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec
from workbench.widgets.compare import CompareError, compare_df

from .test_job_view import two_runs  # noqa: F401  (the same two finished runs)

pytestmark = pytest.mark.slow


def _final_loss(job) -> float:
    rows = [json.loads(x) for x in (job.run_dir.path / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "event" not in r][-1]


def _write_examples(job, name: str, rows: list[dict]) -> str:
    path = job.run_dir.path / "eval" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"eval/{name}"


@pytest.fixture(scope="module")
def scored(two_runs):  # noqa: F811
    """Hand-written eval.jsonl lines, as a scorer would leave them: base before, run after."""
    a, b = two_runs[:2]
    prompts = ["What sound does a cow make?", "What does a cat say?"]
    base = _write_examples(a, "before-0-heldout.jsonl", [
        {"prompt": p, "reference": r, "prediction": "uh"} for p, r in zip(prompts, ["moo", "meow"])])
    results.append(a.run_dir.path, results.record("heldout", {"exact_match": 0.0, "rouge_l": 0.1},
                                                  phase="before", step=0, n=2, model="base",
                                                  examples=base))
    for job, em, answers in ((a, 0.5, ["moo", "woof"]), (b, 0.0, ["baa", "baa"])):
        ex = _write_examples(job, "after-30-heldout.jsonl", [
            {"prompt": p, "reference": r, "prediction": ans}
            for p, r, ans in zip(prompts, ["moo", "meow"], answers)])
        results.append(job.run_dir.path, results.record("heldout", {"exact_match": em},
                                                         phase="after", step=30, n=2,
                                                         examples=ex))
    return a, b


def test_compare_df_shows_final_losses_and_exactly_the_differing_spec_keys(two_runs):  # noqa: F811
    a, b = two_runs[:2]
    df = compare_df([a, b.name])  # a Job and a name
    assert list(df.index) == [a.id, b.id]
    assert sorted(c for c in df.columns if c.startswith("spec:")) == ["spec:name",
                                                                       "spec:train.lr"]
    assert list(df["spec:train.lr"]) == [3e-3, 1e-3]
    assert df.loc[a.id, "final loss"] == _final_loss(a)
    assert df.loc[b.id, "final loss"] == _final_loss(b)
    assert list(df["state"]) == ["succeeded", "succeeded"] and list(df["steps"]) == [30, 30]
    assert (df["best loss"] <= df["final loss"]).all()


def test_eval_scores_from_eval_jsonl_appear_in_the_table(scored):
    a, b = scored
    df = compare_df([a.id, b.id])
    assert df.loc[a.id, "eval:heldout.exact_match"] == 0.5
    assert df.loc[b.id, "eval:heldout.exact_match"] == 0.0
    assert df.loc[a.id, "base:heldout.rouge_l"] == pytest.approx(0.1)
    assert math.isnan(df.loc[b.id, "base:heldout.rouge_l"])  # B recorded no base scores


def test_compare_widget_overlays_runs_and_shows_answers_side_by_side(scored):
    a, b = scored
    view = workbench.compare([a.id, b.id])
    data = view.chart.figure.data
    assert len(data) == 6  # raw, smoothed, eval per run
    assert [d.name for d in data[1::3]] == [a.id, b.id]
    assert list(data[1].y) == pytest.approx(
        [r["loss"] for r in map(json.loads, (a.run_dir.path / "metrics.jsonl").read_text()
                                .splitlines()) if "loss" in r and "event" not in r])
    assert "background:#fff3bf'>spec:train.lr" in view.table.value
    assert "<b>0.5</b>" in view.table.value  # the better exact match is bold
    answers = view.answers.df  # from the example files: nothing generated on construction
    assert list(answers.columns) == ["prompt", "reference", "base", a.id, b.id]
    assert list(answers[a.id]) == ["moo", "woof"] and list(answers[b.id]) == ["baa", "baa"]
    assert list(answers["base"]) == ["uh", "uh"] and "woof" in view.answers.table.value
    generated = view.answers.generate(["What sound does a cow make?"], max_new_tokens=4)
    assert list(generated.columns) == ["prompt", "base", a.id, b.id]
    assert all(isinstance(v, str) for v in generated.iloc[0])
    assert "generated" in view.answers.status.value


def test_cli_compare_prints_both_runs_and_writes_html(two_runs, capsys, tmp_path):  # noqa: F811
    a, b = two_runs[:2]
    out = tmp_path / "cmp.html"
    assert main(["compare", a.id, b.id, "--html", str(out)]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines()}
    assert a.id in rows and b.id in rows and "spec:train.lr" in text
    assert f"{_final_loss(a):.4g}" in rows[a.id] and f"{_final_loss(b):.4g}" in rows[b.id]
    html = out.read_text()
    assert "plotly" in html and a.id in html and b.id in html and "by tokens" in html


def test_bad_inputs_give_typed_errors(two_runs, capsys):  # noqa: F811
    a = two_runs[0]
    with pytest.raises(RunNotFoundError, match="no-such-run"):
        compare_df([a.id, "no-such-run"])
    with pytest.raises(CompareError, match="at least two"):
        workbench.compare([a.id])
    with pytest.raises(CompareError, match="at least two"):
        compare_df([a, a.id])  # the same run twice
    with pytest.raises(CompareError, match="run ids or run names"):
        compare_df([a, 42])
    assert issubclass(CompareError, WorkbenchError)
    assert main(["compare", a.id]) == 1
    assert "at least two" in capsys.readouterr().err
    assert main(["compare", a.id, "nope-run"]) == 1
    assert "no run with id or name 'nope-run'" in capsys.readouterr().err


def test_a_run_with_no_metrics_yet_is_a_row_and_a_message(two_runs, tmp_path):  # noqa: F811
    a = two_runs[0]
    spec = RunSpec(name="not-started")
    rd = RunDir(tmp_path / "not-started").create(spec)
    now = time.time()
    Registry().add_run(RunRecord(id="not-started-1", name="not-started", target="local",
                                 backend_job_id=None, run_dir=str(rd.path), state="pending",
                                 created=now, updated=now))
    try:
        df = compare_df([a.id, "not-started-1"])
        assert df.loc["not-started-1", "state"] == "pending"
        assert pd.isna(df.loc["not-started-1", "final loss"])
        assert df.loc[a.id, "final loss"] == _final_loss(a)
        view = workbench.compare([a.id, "not-started-1"])
        assert "no metrics yet: not-started-1 (pending)" in view.message.value
        assert len(view.chart.figure.data[4].x) == 0
    finally:
        Registry().delete_run("not-started-1")  # other tests list the session's runs
