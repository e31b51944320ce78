"""The service's sweep money on a real ledger (SQLite), metered from real processes: a stand-in
controller (a Python process, as the student's would be) starts trial "supervisors" in sessions
of their own and work of its own; the meter bills each trial from its process's start time to
the tick that saw it gone, at the sweep's rate, charges it once, stops everything before the
hold is passed, and releases the hold once nothing of the sweep runs. The student's sweep.json
is only a label. No training runs here: the real sweep, started and resumed as a real student
through the hub, is tests/course/test_course.py's."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.course.conftest import wait_until
from workbench.course.config import Course
from workbench.course.desk import CourseDesk
from workbench.course.sweep_meter import SweepAttempt
from workbench.course.sweeps import CourseSweeps
from workbench.errors import CourseError, InsufficientCreditError, RunNotFoundError
from workbench.runs.launching import _new_run_id
from workbench.runs.ledger import Ledger

ME = pwd.getpwuid(os.getuid()).pw_name  # the "student" whose processes these are
# A controller: "trial" starts a supervisor-like process in a session of its own (which starts a
# child of its own), "work" a plain child, "end N" ends trial N; end of stdin: all end, it exits.
CONTROLLER = r"""
import subprocess, sys
HOLD = [sys.executable, "-c", "import sys; sys.stdin.read()"]
TRIAL = [sys.executable, "-c", "import subprocess, sys; "
         "c = subprocess.Popen(%r, stdin=subprocess.PIPE); print(c.pid, flush=True); "
         "sys.stdin.read(); c.stdin.close(); c.wait()" % (HOLD,)]
kids = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] in ("trial", "work"):
        p = subprocess.Popen(TRIAL if cmd[0] == "trial" else HOLD, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=cmd[0] == "trial", text=True)
        grandchild = p.stdout.readline().strip() if cmd[0] == "trial" else ""
        kids.append(p)
        print(p.pid, grandchild, flush=True)
    elif cmd[0] == "end":
        kids[int(cmd[1])].stdin.close()
for p in kids:
    p.stdin.close()
for p in kids:
    p.wait()
"""


class Controller:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.ident = (self.proc.pid, psutil.Process(self.proc.pid).create_time())

    def say(self, line: str) -> list[int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        if line.split()[0] in ("trial", "work"):
            return [int(x) for x in self.proc.stdout.readline().split()]
        return []

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def sweeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CourseSweeps:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    course = Course.model_validate({
        "name": "sweeps", "instructors": ["teacher"], "students": [ME, "ben"],
        "default_credit": 10, "state_dir": str(tmp_path / "state"),
        "prices": {"cpu_core_hour": 36}, "caps": {"concurrent_runs": 2}})
    (tmp_path / "state").mkdir(mode=0o711)  # as `workbench course init` makes it
    desk = CourseDesk(course, Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}"))
    desk.open_accounts()
    return CourseSweeps(desk)


def _sweep(sweeps: CourseSweeps, tmp_path: Path, amount: int, rate: float,
           controller: Controller | None, concurrent: int = 1, **record: Any) -> SweepAttempt:
    """A sweep as the service starts one: held, attached, metered from ``controller``; its
    sweep.json (the student's file) says ``record``."""
    folder = tmp_path / "home" / "sweeps" / "s-1"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"state": "running", "trials": [], **record}))
    hold = sweeps.ledger.hold(ME, amount, actor=ME)
    sweeps.ledger.attach_run(hold, "s-1", str(folder), kind="sweep")
    a = SweepAttempt(hold, ME, os.getuid(), "s-1", rate, amount, concurrent)
    if controller is not None:
        sweeps.meter.add_controller(a, controller.ident)
    else:
        sweeps.meter.save(a)
    return a


def _settled(sweeps: CourseSweeps) -> bool:
    """One settle pass; whether no hold is left open."""
    sweeps.settle()
    return not sweeps.ledger.holds(open_only=True)


def _gone(*pids: int) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)


def test_a_trial_is_billed_from_its_start_until_the_meter_saw_it_gone_and_charged_once(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """36 CNY a core-hour is 1 fen a second: a trial that ran about a second is billed the fen
    between its process's start (the kernel's) and the settle that saw it gone; the
    controller's own work is not a trial and is not billed."""
    ctl = Controller()
    try:
        a = _sweep(sweeps, tmp_path, 600, 36.0, ctl)
        trial, grandchild = ctl.say("trial")
        [work] = ctl.say("work")
        started = psutil.Process(trial).create_time()
        assert sweeps.settle() == []  # running: nothing charged, nothing released
        a = sweeps.meter.get(a.hold_id)
        assert a is not None and [t.procs[0][0] for t in a.trials.values()] == [trial]
        assert grandchild in [p for t in a.trials.values() for p, _ in t.procs]
        assert work in [p for p, _ in a.controllers]
        ctl.say("end 0")
        wait_until("the trial to end", lambda: _gone(trial, grandchild), 30)
        ended = time.time()
        charged = sweeps.settle()
        seen = time.time()
        assert len(charged) == 1 and sweeps.settle() == []  # charged once
        [(key, fen)] = sweeps.ledger.charged_trials(a.hold_id).items()
        assert str(trial) in key
        assert (ended - started) <= fen <= (seen - started) + 1, (fen, ended - started)
        assert sweeps.ledger.hold_left(a.hold_id) == 600 - fen
        (tmp_path / "home" / "sweeps" / "s-1" / "sweep.json").write_text(
            json.dumps({"state": "succeeded", "trials": [{"number": 0, "run_id": "r0"}]}))
        ctl.close()
        assert sweeps.settle() == ["s-1"]  # nothing of it runs: the rest released
        account = sweeps.ledger.account(ME)
        assert (account.charges, account.held, account.balance) == (fen, 0, 1000 - fen)
        view = sweeps.view(ME, "s-1")
        assert view["settled"] and view["charged"] == fen
    finally:
        ctl.close()


def test_a_forged_sweep_json_moves_no_money(sweeps: CourseSweeps, tmp_path: Path) -> None:
    """The student's sweep.json says the sweep ended, its trials cost nothing and were released:
    while the trial's process runs the hold stays, and the trial is billed what the meter saw."""
    ctl = Controller()
    try:
        a = _sweep(sweeps, tmp_path, 600, 36.0, ctl)
        [trial, _] = ctl.say("trial")
        forged = {"state": "succeeded", "trials": [
            {"number": 0, "run_id": "r0", "cost": 0.0, "released": True, "state": "succeeded"}]}
        (tmp_path / "home" / "sweeps" / "s-1" / "sweep.json").write_text(json.dumps(forged))
        sweeps.settle()
        assert sweeps.ledger.holds(open_only=True)[0].hold_id == a.hold_id
        assert sweeps.ledger.charged_trials(a.hold_id) == {}
        ctl.close()
        sweeps.settle()
        [fen] = sweeps.ledger.charged_trials(a.hold_id).values()
        assert fen >= 1 and not sweeps.ledger.holds(open_only=True)
        assert trial and _gone(trial)
    finally:
        ctl.close()


def test_a_trial_whose_supervisor_is_killed_takes_its_processes_with_it(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    ctl = Controller()
    try:
        _sweep(sweeps, tmp_path, 600, 36.0, ctl)
        trial, grandchild = ctl.say("trial")
        sweeps.settle()  # seen: the trial and its child
        psutil.Process(trial).kill()
        wait_until("the supervisor to be gone", lambda: _gone(trial), 30)
        sweeps.settle()  # its child is killed: a run does not outlive its supervisor
        wait_until("its child to be ended by the meter", lambda: _gone(grandchild), 30)
    finally:
        ctl.close()


def test_a_sweep_is_stopped_before_its_bill_passes_its_hold(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """3,600 CNY an hour is one yuan a second: a hold of 0.30 CNY is reached within the meter's
    margin at once, so every process of the sweep is stopped, and the charge is at most the
    hold."""
    ctl = Controller()
    try:
        a = _sweep(sweeps, tmp_path, 30, 3600.0, ctl)
        trial, grandchild = ctl.say("trial")
        sweeps.settle()
        wait_until("the sweep to be stopped and settled", lambda: _settled(sweeps), 60)
        assert _gone(trial, grandchild, ctl.proc.pid)
        assert sum(sweeps.ledger.charged_trials(a.hold_id).values()) <= 30
        assert sweeps.ledger.balance(ME) >= 1000 - 30
        got = sweeps.meter.get(a.hold_id)
        assert got is not None and "hold" in got.why
    finally:
        ctl.close()


def test_the_concurrent_cap_counts_what_the_service_admitted_not_the_students_file(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """Admitted with two trials at once, the sweep counts two against the cap of 2, whatever its
    sweep.json says; a launch is refused until it ends."""
    _sweep(sweeps, tmp_path, 300, 36.0, None, concurrent=2, concurrent_in_file=1)
    with pytest.raises(CourseError, match="allows 2 at once"):
        sweeps.desk._check_concurrent(ME)


def test_another_student_cannot_see_or_stop_a_sweep_an_instructor_can_see(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    _sweep(sweeps, tmp_path, 300, 36.0, None)
    for call in (sweeps.view, sweeps.stop):
        with pytest.raises(CourseError, match="not ben's"):
            call("ben", "s-1")
    assert sweeps.sweeps("ben") == []
    assert [v["sweep"] for v in sweeps.sweeps("teacher")] == ["s-1"]
    with pytest.raises(RunNotFoundError):
        sweeps.view(ME, "no-such-sweep")


@pytest.mark.parametrize(("space", "options", "match"), [
    ({"resources.processes_per_node": [1, 2]}, {}, "the course sets resources"),
    ({"budget.price_per_cpu_core_hour": [1.0]}, {}, "the course sets budget"),
    ({"train.lr": {"low": 1e-4, "high": 1e-3}}, {"strategy": "random", "trials": 2},
     "give budget=N"),
    ({"train.lr": [1e-3]}, {"budget": -1}, "positive amount"),
    ({"train.lr": [1e-3]}, {"controller": "mine"}, "not \\['controller'\\]"),
    ({"train.lr": [1e-3]}, {"concurrent": 3}, "allows 2 at once"),
    ({"train.lr": [1e-3]}, {"concurrent": 0}, "whole number"),
])
def test_a_sweep_the_course_cannot_hold_is_refused_before_anything_is_written(
        sweeps: CourseSweeps, tmp_path: Path, space: dict, options: dict, match: str) -> None:
    with pytest.raises(CourseError, match=match):
        sweeps.start("ben", {"train": {"max_steps": 2}}, space, options)
    assert sweeps.ledger.entries("ben")[-1]["kind"] == "credit"
    assert not (tmp_path / "state" / "sweep-meters").exists()


def test_a_budget_past_the_credit_is_refused_before_anything_is_written(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    with pytest.raises(InsufficientCreditError, match="nothing was started"):
        # A range: nothing to quote, so the budget asked is what would be held.
        sweeps.start("ben", {"train": {"max_steps": 2}}, {"train.lr": {"low": 1e-4, "high": 1e-3}},
                     {"strategy": "random", "trials": 2, "budget": 10.01})
    assert [e["kind"] for e in sweeps.ledger.entries("ben")] == ["credit"]
    assert not (tmp_path / "state" / "sweep-meters").exists()


def test_a_stop_is_final_and_the_rest_is_released(sweeps: CourseSweeps,
                                                  tmp_path: Path) -> None:
    """An instructor stops a sweep whose student's side cannot answer (here the worker refuses
    to run as root, or the user has no sudo): the service stops the sweep's processes itself,
    resumes nothing, and releases what the trial did not use."""
    ctl = Controller()
    try:
        a = _sweep(sweeps, tmp_path, 500, 36.0, ctl)
        trial, _ = ctl.say("trial")
        sweeps.settle()
        assert sweeps.stop("teacher", "s-1")["sweep"] == "s-1"
        wait_until("the stopped sweep to be settled", lambda: _settled(sweeps), 60)
        assert _gone(trial, ctl.proc.pid)
        fen = sum(sweeps.ledger.charged_trials(a.hold_id).values())
        account = sweeps.ledger.account(ME)
        assert (account.held, account.balance) == (0, 1000 - fen) and fen < 500
    finally:
        ctl.close()


def test_a_sweep_whose_controller_dies_and_cannot_be_resumed_is_ended_and_charged(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """The controller is killed with a trial running and its sweep.json not ended: the service
    asks the student's side to resume it (here the worker refuses, as it does for root, or the
    user has no sudo rule); then the trial, which no controller will end, is stopped, charged
    what the meter saw, and the rest released with the reason in the ledger."""
    ctl = Controller()
    try:
        a = _sweep(sweeps, tmp_path, 500, 36.0, ctl)
        trial, grandchild = ctl.say("trial")
        sweeps.settle()
        ctl.proc.kill()
        ctl.proc.wait()
        wait_until("the sweep to be ended and settled", lambda: _settled(sweeps), 60)
        assert _gone(trial, grandchild)
        got = sweeps.meter.get(a.hold_id)
        assert got is not None and got.resumes == 1 and "could not be resumed" in got.why
        fen = sum(sweeps.ledger.charged_trials(a.hold_id).values())
        assert fen >= 1 and sweeps.ledger.balance(ME) == 1000 - fen
        release = sweeps.ledger.entries(ME)[-1]
        assert release["kind"] == "release" and "could not be resumed" in release["note"]
    finally:
        ctl.close()


def _supervisor(run_dir: Path) -> subprocess.Popen:
    """A stand-in run supervisor: a session leader whose command line names ``run_dir`` as
    ``python -m workbench.runs.supervise RUN_DIR`` does; it ends when its stdin is closed."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()",
                             "workbench.runs.supervise", str(run_dir)],
                            stdin=subprocess.PIPE, start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.mark.parametrize("recorded", ["run_id", "run_name only"])
def test_a_trial_whose_controller_died_before_the_meter_saw_it_is_still_billed(
        sweeps: CourseSweeps, tmp_path: Path, recorded: str) -> None:
    """A supervisor the controller started and then lost (killed before a settle pass saw the
    child) is found among the student's processes by the run it names, a trial of the sweep, and
    billed from its own start time: by the run's id, or, killed before the record got the id, by
    the name the trial was given before its launch (the run's directory is that name, a launch
    time and 4 hex digits, as launch() makes it). Another run's supervisor is not adopted."""
    run_id = _new_run_id("sw-ab12-t0")
    trial = ({"number": 0, "run_name": "sw-ab12-t0", "run_id": run_id} if recorded == "run_id"
             else {"number": 0, "run_name": "sw-ab12-t0", "state": "waiting"})
    a = _sweep(sweeps, tmp_path, 600, 36.0, None, trials=[trial])
    orphan = _supervisor(tmp_path / "runs" / run_id)
    other = _supervisor(tmp_path / "runs" / _new_run_id("sw-ab12-t01"))
    try:
        started = psutil.Process(orphan.pid).create_time()
        sweeps.settle()
        got = sweeps.meter.get(a.hold_id)
        assert got is not None and [t.run for t in got.trials.values()] == [run_id]
        assert [t.start for t in got.trials.values()] == [started]
    finally:
        _end(orphan)
        _end(other)
    wait_until("the orphan's trial to be settled", lambda: _settled(sweeps), 60)
    [fen] = sweeps.ledger.charged_trials(a.hold_id).values()
    assert fen >= 1
