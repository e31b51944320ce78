"""Sweeps with real trials: 2 gloo ranks each on the built-in tiny model, 2 trials at once.

CPU time is priced through budget.price_per_cpu_core_hour, as in test_budget.py: 3,600 per
process-core-hour is one unit per second per process, two per second for a trial, so a limit is
a number of seconds this file can reason about. Costs are read from each trial's own status.json
and recomputed from its billed seconds at that price (never with the code's formula).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import workbench
from tests.waiting import seen_stopped, wait_for
from workbench.errors import SweepError, SweepNotFoundError, WorkbenchError
from workbench.runs.procs import ProcessIdentity
from workbench.runs.registry import Registry

PRICE = 3600.0
PER_SECOND = 2.0  # at PRICE with 2 processes

SPEC = {"name": "sw", "train": {"max_steps": 6, "eval_every": 2, "lr": 3e-3},
        "data": {"eval_samples": 8}, "checkpoint": {"keep": 1},
        "budget": {"price_per_cpu_core_hour": PRICE}}


def _wait_for(cond, timeout: float, what: str):
    return wait_for(cond, timeout, what, every=0.5)


# -- bad inputs: refused before anything is written ------------------------------------------------
@pytest.mark.parametrize("kwargs, says", [
    ({"space": {"train.learning_rate": [1e-4]}}, "did you mean 'train.lr'"),
    ({"space": {"trian.lr": [1e-4]}}, "did you mean 'train'"),
    ({"space": {}}, "space is empty"),
    ({"space": {"train.lr": []}}, "empty list"),
    ({"space": {"train.lr": [1e-4]}, "budget": -5}, "budget must be a positive amount"),
    ({"space": {"train.lr": [2.0]}}, "refused by the spec"),
    ({"space": {"train.lr": {"low": 1e-4, "high": 1e-2}}}, "a grid needs a list"),
    ({"space": {"train.lr": [1e-4]}, "trials": 3}, "the grid has 1 points"),
    ({"space": {"train.lr": [1e-4]}, "strategy": "random"}, "needs trials=N"),
    ({"space": {"train.lr": [1e-4]}, "strategy": "bayes"}, "not one of grid, random, optuna"),
    ({"space": {"train.lr": [1e-4]}, "objective": "rouge"}, "eval.<task>.<metric>"),
    ({"space": {"train.lr": [1e-4]}, "concurrent": 0}, "concurrent must be"),
    ({"space": {"budget.limit": [1, 2]}}, "give the sweep budget="),
])
def test_bad_inputs_are_refused_with_what_to_do(wb_home, kwargs, says):
    before = sorted((wb_home / "sweeps").iterdir()) if (wb_home / "sweeps").is_dir() else []
    with pytest.raises(SweepError, match=None) as err:
        workbench.sweep(SPEC, **kwargs)
    assert says in str(err.value)
    after = sorted((wb_home / "sweeps").iterdir()) if (wb_home / "sweeps").is_dir() else []
    assert after == before  # nothing written


def test_eval_loss_objective_needs_a_validation_split():
    spec = {**SPEC, "data": {"validation_fraction": 0.0}}
    with pytest.raises(SweepError, match="validation_fraction is 0"):
        workbench.sweep(spec, space={"train.lr": [1e-4]})


def test_money_shows_what_was_spent_and_what_is_held_apart():
    from workbench.sweep.budget import money

    # Six trials started, none ended: everything is held, nothing is spent yet.
    started = {"budget": 1500, "currency": "CNY",
               "trials": [{"state": "running", "limit": 250} for _ in range(6)]}
    assert money(started) == "spent 0 · held 1500 of 1500 CNY"
    ended = {"budget": 100, "currency": "CNY", "trials": [
        {"state": "succeeded", "released": True, "cost": 12.5, "limit": 30},
        {"state": "pruned", "released": True, "cost": 0.25, "limit": 30},
        {"state": "running", "limit": 30}, {"state": "waiting", "limit": 30},
        {"state": "skipped", "limit": None}]}
    assert money(ended) == "spent 12.75 · held 30 of 100 CNY"


@pytest.mark.parametrize("others, waiting, slots, factor", [
    # Cases worked by hand with two trials taking turns evenly (each half as fast beside
    # another), for a trial of 10 s of work alone.
    ([], 0, 2, 1.0),  # nothing beside it
    ([], 1, 2, 2.0),  # its twin starts with it: both take 20 s
    ([4.0], 0, 2, 1.4),  # a neighbour with 4 s left ends at 8 s, having let it do 4 s; 6 s alone
    ([4.0], 1, 2, 2.0),  # ... and a waiting trial takes the freed slot: it shares to the end
    ([30.0], 0, 2, 2.0),  # a neighbour that outlasts it
    ([], 3, 1, 1.0),  # one slot: the waiting trials never run beside it
    ([float("inf")], 0, 2, 2.0),  # a neighbour of unknown length counts as sharing throughout
])
def test_a_trial_is_priced_for_the_overlap_it_can_still_have(others, waiting, slots, factor):
    from workbench.sweep.budget import beside

    assert beside(10.0, others, waiting, slots, slow=float) == pytest.approx(factor)


def test_a_running_trials_work_left_is_its_plan_less_what_it_ran_at_its_slowdown():
    from workbench.sweep.budget import left_s

    trial = {"alone_s": 10.0, "launched": 100.0, "sharing": 2.0}
    assert left_s(trial, now=108.0, default=99.0) == pytest.approx(6.0)
    assert left_s(trial, now=200.0, default=99.0) == 0.0
    assert left_s({"launched": 100.0}, now=108.0, default=99.0) == 99.0


def test_unknown_sweep_is_a_typed_error():
    with pytest.raises(SweepNotFoundError, match="no sweep"):
        workbench.get_sweep("no-such-sweep")


def test_yaml_sweep_section_is_split_from_the_spec(tmp_path):
    from workbench.sweep.start import split_yaml

    path = tmp_path / "s.yaml"
    path.write_text("name: y\ntrain: {max_steps: 4}\nsweep:\n  space: {train.lr: [0.001, 0.003]}\n"
                    "  concurrent: 2\n  budget: 40\n")
    spec, kwargs = split_yaml(path)
    assert (spec.name, spec.train.max_steps) == ("y", 4)
    assert kwargs == {"space": {"train.lr": [0.001, 0.003]}, "concurrent": 2, "budget": 40}
    path.write_text("name: y\nsweep:\n  spaces: {train.lr: [0.001]}\n")
    with pytest.raises(SweepError, match="unknown key"):
        split_yaml(path)


def test_the_median_pruner_never_judges_a_trial_at_its_first_evaluation():
    """Evaluations fall at training steps 2, 4, ...: a far worse first value is not enough."""
    import optuna

    from workbench.sweep.study import _pruner

    study = optuna.create_study(direction="minimize", pruner=_pruner("median", startup=1))
    done = study.ask()
    for step, value in ((2, 1.0), (4, 0.9), (6, 0.8)):
        done.report(value, step)
    study.tell(done, 0.8)
    worse = study.ask()
    worse.report(5.0, 2)  # its first evaluation
    assert not worse.should_prune()
    worse.report(5.0, 4)  # its second: now it is judged, and it is clearly worse
    assert worse.should_prune()
    better = study.ask()
    for step, value in ((2, 0.5), (4, 0.4)):
        better.report(value, step)
        assert not better.should_prune()


# -- a controller killed between two steps ---------------------------------------------------------
# Controller.__init__ reads the record written by workbench.sweep (its detached start is replaced
# by nothing here: this test plays the killed controller itself, in-process, without training).
def _recorded_sweep(monkeypatch, **kwargs):
    import importlib

    # (workbench.sweep is also the function that starts a sweep: import the module by its name)
    runner = importlib.import_module("workbench.sweep.runner")
    monkeypatch.setattr(runner, "start_controller", lambda record: None)
    return workbench.sweep(SPEC, **kwargs)


def test_a_resumed_controller_makes_record_and_study_agree_again(monkeypatch):
    import optuna

    from workbench.sweep.runner import Controller

    s = _recorded_sweep(monkeypatch, space={"train.lr": [1e-3, 3e-3], "method.lora_r": [4, 8]})
    dead = Controller(s.record)
    first = dead._next_waiting()  # asked and recorded
    # Trial 0 ended (written to the record) but the controller was killed before telling the
    # study; trial 1 was asked from the study but the controller was killed before recording it.
    s.record.update_trial(first["number"], state="succeeded", value=0.5, released=True, cost=1.0)
    lost = dead.study.ask()
    lost_params = {"train.lr": lost.suggest_categorical("train.lr", [1e-3, 3e-3]),
                   "method.lora_r": lost.suggest_categorical("method.lora_r", [4, 8])}
    del dead

    Controller(s.record)._reconcile()
    study = optuna.load_study(study_name="sweep", storage=s.record.study_url)
    trials = {t["number"]: t for t in s.trials}
    assert sorted(trials) == sorted(t.number for t in study.trials) == [0, 1]
    assert trials[1]["state"] == "waiting" and trials[1]["params"] == lost_params
    assert lost_params != trials[0]["params"]  # its own grid point, not lost to a FAIL
    told = {t.number: t for t in study.trials}
    assert told[0].state == optuna.trial.TrialState.COMPLETE and told[0].value == 0.5
    assert told[1].state == optuna.trial.TrialState.RUNNING  # waiting to start, not failed
    # The next controller starts the adopted trial before asking the study for another.
    assert Controller(s.record)._next_waiting()["number"] == 1
    assert len(optuna.load_study(study_name="sweep", storage=s.record.study_url).trials) == 2


def test_a_valued_trial_without_its_run_is_no_best_and_breaks_no_listing(monkeypatch, tmp_path):
    """A record mended by hand (a value, no run): best says no trial has a value instead of a
    KeyError, and the panel's listing of runs and sweeps still answers."""
    from workbench_lab.view import RunsView

    s = _recorded_sweep(monkeypatch, space={"train.lr": [1e-3, 3e-3]})
    s.record.update_trial(0, state="succeeded", value=0.5, released=True, cost=1.0)
    with pytest.raises(WorkbenchError, match="no trial with a value"):
        _ = s.best
    group = next(g for g in RunsView(tmp_path).runs()["sweeps"] if g["id"] == s.id)
    assert group["best"] is None


def test_a_grid_sweep_can_tell_the_study_its_last_point(monkeypatch):
    """The controller asks and tells without Study.optimize(): covering the whole grid must not
    make the sampler stop an optimisation loop that does not exist."""
    import optuna

    from workbench.sweep.runner import Controller

    s = _recorded_sweep(monkeypatch, space={"train.lr": [1e-3, 3e-3]})
    controller = Controller(s.record)
    asked = [controller.study.ask() for _ in range(2)]
    for trial, value in zip(asked, (0.5, 0.4), strict=True):
        trial.suggest_categorical("train.lr", [1e-3, 3e-3])
        controller.study.tell(trial.number, value)
    study = optuna.load_study(study_name="sweep", storage=s.record.study_url)
    assert sorted(t.params["train.lr"] for t in study.trials) == [1e-3, 3e-3]
    assert study.best_value == 0.4


def test_a_trial_that_ended_without_an_end_time_is_finished_once_its_bill_is_waited_for(
        monkeypatch, tmp_path):
    """A run stopped before its supervisor wrote the end (status.json keeps "ended": null, no
    closed bill) is still finished by the controller, at its whole limit, after the wait."""
    import importlib

    from workbench.runs.jobs import Job
    from workbench.runs.registry import RunRecord
    from workbench.runs.rundir import RunDir
    from workbench.spec import RunSpec
    from workbench.sweep.runner import Controller

    runner = importlib.import_module("workbench.sweep.runner")
    monkeypatch.setattr(runner, "RELEASE_WAIT_S", 1.0)
    s = _recorded_sweep(monkeypatch, space={"train.lr": [1e-3]}, budget=50.0)
    controller = Controller(s.record)
    n = controller._next_waiting()["number"]
    rd = RunDir(tmp_path / "cut-short").create(RunSpec(name="cut-short"))
    rd.write_status(state="pruned", ended=None, cost=3.0)  # the supervisor never closed the bill
    # What the run reached before it was stopped: eval_loss 2.5 at step 10, 2.1 at step 20.
    rd.metrics_file.write_text('{"step": 10, "eval_loss": 2.5}\n{"step": 20, "eval_loss": 2.1}\n')
    now = time.time()
    record = RunRecord(id="cut-short", name="cut-short", target="local", backend_job_id=None,
                       run_dir=str(rd.path), state="pruned", created=now, updated=now)
    controller.registry.add_run(record)
    s.record.update_trial(n, state="pruned", run_id="cut-short", limit=20.0)
    controller.active[n] = Job(record, registry=controller.registry)

    def finished():
        controller._watch()
        return not controller.active

    try:
        _wait_for(finished, 30, "the controller to finish the trial")
    finally:
        controller.registry.delete_run("cut-short")
    (trial,) = s.trials
    assert trial["released"] and not trial["cost_final"]
    assert trial["cost"] == 20.0  # a bill never closed counts as the whole limit
    # Stopped early: no value to rank it by, but the table says what it last reached, as its
    # run's own curve does, rather than a blank beside a run that shows an eval loss.
    assert trial["value"] is None and trial["last"] == {"step": 20, "value": 2.1}
    row = s.trials_df().iloc[0]
    assert row["eval_loss (last seen)"] == "2.1 at step 20"


# The main thread of this child ends on its own (the SYS_exit system call, not exit_group), the way
# a process killed with kill -9 loses its main thread first: from then on it shows as a zombie,
# while another thread still holds its files (the controller lock) until the test closes its stdin.
_DYING_CONTROLLER = """
import ctypes, os, platform, sys, threading
from workbench.runs.procs import ProcessIdentity
from workbench.sweep.record import SweepRecord

record = SweepRecord(sys.argv[1])
held = record.controller_lock()  # kept referenced: the lock is released when it is collected
assert held.__enter__()
record.write(controller=ProcessIdentity.me("sweep-controller").to_dict())
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0))).start()
print("holding", flush=True)
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
"""


def test_a_controller_whose_main_thread_is_gone_is_not_alive_once_its_lock_is_released(
        monkeypatch):
    import contextlib

    from workbench.sweep.record import SweepRecord, controller_alive

    s = _recorded_sweep(monkeypatch, space={"train.lr": [1e-3]})
    child = subprocess.Popen([sys.executable, "-c", _DYING_CONTROLLER, str(s.record.path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        controller = ProcessIdentity.from_dict(s.data()["controller"])
        _wait_for(lambda: not controller.alive(), 30, "the child's main thread to end")
        with s.record.controller_lock() as free:
            assert not free  # gone as a process, its last thread still holds the lock
        # The child's last thread ends (and the kernel releases the lock) once controller_alive
        # has seen the lock held by a controller that is gone, not at a time of its own.
        probes: list[bool] = []
        real_lock = SweepRecord.controller_lock

        @contextlib.contextmanager
        def probed(self, wait_s=0.0):
            with real_lock(self, wait_s) as free:
                probes.append(free)
                if not free and len(probes) == 1:
                    child.stdin.close()
                yield free

        monkeypatch.setattr(SweepRecord, "controller_lock", probed)
        alive = controller_alive(s.record)
    finally:
        if not child.stdin.closed:
            child.stdin.close()
        child.wait(timeout=60)
    assert probes[0] is False and probes[-1] is True, probes
    assert alive is False  # the dying controller's lock was waited for, not taken as a live one


# -- real trials ----------------------------------------------------------------------------------
def _run_cost(run_dir: str) -> float:
    status = json.loads((__import__("pathlib").Path(run_dir) / "status.json").read_text())
    assert "released" in status, status  # the final bill
    assert status["cost"] == pytest.approx(PER_SECOND * status["billed_s"], rel=1e-6)
    return float(status["cost"])


@pytest.mark.slow
def test_budget_sweep_survives_a_controller_restart_and_never_overspends(wb_home):
    """4 grid trials, one at a time, a limit too small for all four; the controller is killed -9
    once a trial has ended and a new Python process resumes the sweep."""
    from workbench.spec import RunSpec
    from workbench.sweep.budget import trial_price

    # The limit is set from this machine's clock, not a fixed figure (a trial here takes 8-20 s
    # held, with the machine's speed): one trial's cost, measured now, and what the controller
    # sets aside before starting one. It pays for the first trial and the reserve of a second,
    # never for the third's reserve on top of three trials, so the limit bites.
    # Planned first: a fresh home's first plan builds the built-in model and measures the clock
    # (seconds), which the measured run's bill would carry (its standby starts before planning).
    workbench.plan({**SPEC, "name": "sw-alone"})
    alone = workbench.launch({**SPEC, "name": "sw-alone"})
    assert alone.wait(progress=False, timeout=400) == "succeeded"
    trial_cost = _run_cost(alone.run_dir.path)
    reserve = max(trial_price(RunSpec.parse({**SPEC, "method": {"lora_r": r}})).need for r in (4, 8))
    limit = reserve + 1.5 * trial_cost
    s = workbench.sweep(SPEC, space={"train.lr": [1e-3, 3e-3], "method.lora_r": [4, 8]},
                        concurrent=1, budget=limit, pruner="none")
    assert s.data()["trials_total"] == 4

    controller = ProcessIdentity.from_dict(s.data()["controller"])

    def one_ended():
        return [t for t in s.trials if t.get("released") and t.get("run_id")]

    # The record is read with the controller stopped (SIGSTOP), and it is killed in that state:
    # it cannot go on to end the next trial, and the sweep, between the read and the kill.
    wait_for(lambda: seen_stopped(controller, one_ended), 400, "a trial to end")
    assert s.state == "running"  # something is left to resume
    assert controller.signal(signal.SIGKILL)
    _wait_for(lambda: not controller.alive(), 60, "the controller to die")
    released = [t for t in s.trials if t.get("released")]
    # A trial released without a run was skipped because the budget left could not pay for it
    # (fast trials spend the limit before the kill); never a launch that failed.
    assert all(t.get("run_id") or t["state"] == "skipped" for t in released), released
    before = {t["number"]: (t.get("run_id"), t["state"]) for t in released}
    # Its lock is released only once its last thread has exited; controller_alive waits for that.
    assert not s.controller_alive
    with pytest.raises(SweepError, match="resume"):
        s.wait(progress=False, timeout=30)

    code = (f"import workbench; s = workbench.get_sweep({s.id!r}).resume(); "
            "print('STATE', s.wait(progress=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**os.environ})
    assert out.returncode == 0, out.stderr[-3000:]
    state = out.stdout.split("STATE")[-1].strip()
    assert state in ("succeeded", "budget_stopped"), s.record.log_file.read_text()[-3000:]

    trials = {t["number"]: t for t in s.trials}
    for n, (run_id, st) in before.items():  # finished trials were kept, not run again
        assert (trials[n].get("run_id"), trials[n]["state"]) == (run_id, st)
    tag = s.id.rsplit("-", 1)[-1]
    runs = [r for r in Registry().list_runs() if f"-{tag}-t" in r.name]
    assert sorted(r.name for r in runs) == sorted({r.name for r in runs})  # one run per trial
    assert {r.id for r in runs} == {t["run_id"] for t in trials.values() if t.get("run_id")}
    # The sum of the trials' final bills (from their own status.json) is within the limit...
    spent = sum(_run_cost(r.run_dir) for r in runs)
    assert spent <= limit
    assert s.spent == pytest.approx(spent, abs=1e-6)
    # ... and the limit bit: not every trial ran to its end.
    assert sum(1 for t in trials.values() if t.get("state") == "succeeded") < 4
    assert state == "budget_stopped" or any(t["state"] == "budget_stopped" for t in trials.values())
    import optuna

    study = optuna.load_study(study_name="sweep", storage=s.record.study_url)
    # Every trial the study was asked for is in the record (none lost across the kill, none asked
    # again), and every one was told how it ended.
    assert sorted(t.number for t in study.trials) == sorted(trials)
    assert all(t.state.is_finished() for t in study.trials), [t.state for t in study.trials]
    started = [tuple(sorted(t["params"].items())) for t in trials.values() if t.get("run_id")]
    assert len(started) == len(set(started))  # no grid point was run twice
    df = s.trials_df()
    assert list(df["trial"]) == sorted(trials)


@pytest.mark.slow
def test_a_prune_request_ends_the_run_pruned():
    """The cancel path with a reason: a run stopped on a sweep's prune request ends 'pruned'."""
    from workbench.runs.rundir import PRUNE_REQUEST

    job = workbench.launch({**SPEC, "name": "prune-me", "train": {"max_steps": 500}})
    _wait_for(lambda: (job.status().get("step") or 0) >= 1, 300, "the first step")
    job.cancel(stop_request=PRUNE_REQUEST)
    assert job.wait(progress=False, timeout=120) == "pruned"
    assert "released" in job.status()  # the supervisor wrote it, with its final bill
    assert job.record.state == "pruned"


@pytest.mark.slow
def test_an_objective_no_trial_reports_fails_the_sweep_clearly():
    s = workbench.sweep({**SPEC, "train": {"max_steps": 2}}, space={"train.lr": [1e-3, 3e-3]},
                        objective="eval.judge.win_rate", concurrent=1)
    assert s.wait(progress=False, timeout=400) == "failed"
    error = s.data()["error"]
    assert "'eval.judge.win_rate' was not reported" in error and "eval_loss" in error
    assert len([t for t in s.trials if t.get("run_id")]) == 1  # no second trial was started
    with pytest.raises(WorkbenchError, match="no trial with a value"):
        _ = s.best
