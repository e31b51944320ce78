"""Evaluation inside real 2-process training runs, and job.evaluate / `workbench eval` after them.

Two runs of the same spec and seed, one scoring before / every 10 steps / after (heldout,
perplexity and a real lm-eval task on local data), one not scoring at all: the loss curves must
be the same, and the scores must move with training.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

import workbench
from tests.evaluate_support import JudgeServer, write_sounds_task
from workbench.errors import EvalError, JudgeError
from workbench.evaluate import results

pytestmark = pytest.mark.slow

STEPS = 40


@pytest.fixture(scope="module")
def runs(wb_home, tmp_path_factory):
    task = write_sounds_task(tmp_path_factory.mktemp("lmeval"))
    train = {"max_steps": STEPS, "lr": 3e-3, "seed": 7}
    scored = workbench.launch({"name": "eval-scored", "train": train, "eval": {
        "before": True, "every_steps": 10, "after": True,
        "tasks": [{"kind": "heldout", "max_samples": 8, "max_new_tokens": 6},
                  {"kind": "perplexity", "max_samples": 8},
                  {"kind": "lm_eval", "tasks": [str(task)]}]}})
    plain = workbench.launch({"name": "eval-plain", "train": train,
                              "eval": {"before": False, "after": False}})
    # One process on this 2-core machine: a core is spare, so every_steps scores beside it.
    # Started with the others so that its start-up and waits overlap theirs. Its rank trains on
    # one thread, the one core the evaluation does not get (a lone rank otherwise takes every
    # core, and its threads spin-wait for the ones the evaluation and the other runs hold).
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        beside = workbench.launch({"name": "eval-beside", "resources": {"processes_per_node": 1},
                                   "train": {"max_steps": BESIDE_STEPS, "lr": 3e-3},
                                   "eval": {"every_steps": 6, "after": False,
                                            "tasks": [{"kind": "perplexity", "max_samples": 8}]}})
    for job in (scored, plain, beside):
        assert job.wait(timeout=900, progress=False) == "succeeded", job.logs(tail=40)
    return scored, plain, beside


@pytest.fixture(scope="module")
def beside(runs):
    return runs[2]


BESIDE_STEPS = 18


def _losses(job):
    return [(m["step"], m["loss"]) for m in job.metrics() if "loss" in m and "event" not in m]


def test_eval_during_training_leaves_the_loss_curve_alone(runs):
    scored, plain, _ = runs
    a, b = _losses(scored), _losses(plain)
    assert [s for s, _ in a] == list(range(1, STEPS + 1))
    assert [s for s, _ in a] == [s for s, _ in b]
    assert [loss for _, loss in a] == pytest.approx([loss for _, loss in b], abs=1e-6)
    assert not (plain.run_dir.path / results.FILE).exists()  # eval off: nothing scored


def test_every_steps_beside_a_one_process_run_does_not_stop_training(runs, beside):
    scored, *_ = runs
    # The 2-process run uses both cores: it paused, and says why.
    assert scored.status()["eval_every_steps"]["mode"] == "pause"
    placed = beside.status()["eval_every_steps"]
    assert placed["mode"] == "beside" and "spare" in placed["reason"], placed
    lines = results.read(beside.run_dir.path)
    assert [(ln["phase"], ln["step"], ln["task"]) for ln in lines] == [
        ("during", s, "perplexity") for s in (6, 12, 18)]
    assert all(ln["n"] == 8 for ln in lines)
    steps = [m for m in beside.metrics() if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, BESIDE_STEPS + 1))
    # Training went past each scored step before that step's scores were written: the
    # evaluation ran while the run trained (a pause would log no later step before them).
    for ln in lines[:-1]:
        later = [m["step"] for m in steps if m["step"] > ln["step"] and m["time"] < ln["time"]]
        assert later, (ln, steps)
    assert not list((beside.run_dir.path / "eval").glob(".weights-*"))  # cleaned up
    assert "eval_error" not in beside.status()


def test_scores_are_recorded_at_each_point_and_move_with_training(runs):
    scored, *_ = runs
    lines = results.read(scored.run_dir.path)
    points = sorted({(ln["phase"], ln["step"], ln["model"]) for ln in lines})
    assert points == [("after", STEPS, "run"), ("before", 0, "base"), ("during", 10, "run"),
                      ("during", 20, "run"), ("during", 30, "run")]
    by = {(ln["phase"], ln["task"]): ln for ln in lines}
    assert {t for _, t in by} == {"heldout", "perplexity", "lm_eval:wb_sounds"}
    before, after = by[("before", "perplexity")], by[("after", "perplexity")]
    assert after["metrics"]["perplexity"] < before["metrics"]["perplexity"] / 2
    assert (by[("after", "lm_eval:wb_sounds")]["metrics"]["acc"]
            > by[("before", "lm_eval:wb_sounds")]["metrics"]["acc"])
    assert by[("after", "heldout")]["n"] == 8
    rows = (scored.run_dir.path / by[("after", "heldout")]["examples"]).read_text().splitlines()
    assert len(rows) == 8 and {"prompt", "reference", "prediction"} <= set(json.loads(rows[0]))
    status = scored.status()
    assert status["eval"]["perplexity.perplexity"] == after["metrics"]["perplexity"]
    assert "eval_error" not in status


def test_job_evaluate_with_a_judge_and_bad_judges_leave_the_run_intact(runs):
    scored, *_ = runs
    server = JudgeServer()
    try:
        before = results.read(scored.run_dir.path)
        report = scored.evaluate([{"kind": "judge", "judge": server.url, "max_samples": 4}])
        line = report.lines[0]
        assert (line["task"], line["phase"], line["model"], line["baseline"], line["n"]) == (
            "judge", "manual", "run", "base", 4)
        # Tuned and base answers reach the judge in both orders: 8 requests for 4 prompts.
        assert len(server.requests) == 8 and 0 <= line["metrics"]["win_rate"] <= 1
        server.mode = "nonsense"
        report = scored.evaluate([{"kind": "judge", "judge": server.url, "max_samples": 2}])
        assert report.lines[0]["metrics"]["unparseable"] == 4
    finally:
        server.close()
    with pytest.raises(JudgeError):  # the server is gone now
        scored.evaluate([{"kind": "judge", "judge": server.url, "max_samples": 2}])
    after = results.read(scored.run_dir.path)
    assert after[:len(before)] == before and len(after) == len(before) + 2
    assert scored.state == "succeeded" and scored.artefact().is_dir()
    assert scored.status()["eval"]["judge.unparseable"] == 4


def test_cli_eval_scores_an_ended_run(runs):
    from workbench.cli import run

    scored, *_ = runs
    table = run(["eval", scored.id, "--tasks", "perplexity", "--max-samples", "4"])
    assert table.splitlines()[0].split()[:4] == ["TASK", "MODEL", "STEP", "N"]
    assert table.splitlines()[1].split()[:4] == ["perplexity", "run", str(STEPS), "4"]
    # In place, without the registry (what runs on a remote run's target): the same scorer,
    # a line in the run's own eval.jsonl; a folder that is no run is a clear error.
    before = len(results.read(scored.run_dir.path))
    table = run(["eval", "--run-dir", str(scored.run_dir.path), "--tasks", "perplexity",
                 "--max-samples", "4"])
    assert table.splitlines()[1].split()[:4] == ["perplexity", "run", str(STEPS), "4"]
    assert len(results.read(scored.run_dir.path)) == before + 1
    with pytest.raises(EvalError, match="not a run directory"):
        run(["eval", "--run-dir", str(scored.run_dir.path / "logs")])
