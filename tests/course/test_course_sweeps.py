"""The service's sweep money on a real ledger (SQLite): a sweep's hold is charged trial by trial
as the sweep record says each trial's bill is final, each trial once, and released only once the
sweep has ended with no trial still running. The sweep record is written here as the sweep
runner writes it (workbench/sweep/record.py's format), so no training runs: the real sweep
through the hub is tests/course/test_course.py's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from workbench.course.config import Course
from workbench.course.desk import CourseDesk
from workbench.course.sweeps import CourseSweeps
from workbench.errors import CourseError, InsufficientCreditError, RunNotFoundError
from workbench.runs.ledger import Ledger
from workbench.runs.procs import ProcessIdentity
from workbench.sweep.record import SweepRecord


@pytest.fixture
def sweeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CourseSweeps:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    course = Course.model_validate({
        "name": "sweeps", "instructors": ["teacher"], "students": ["ana", "ben"],
        "default_credit": 10, "state_dir": str(tmp_path / "state"),
        "prices": {"cpu_core_hour": 36}, "caps": {"concurrent_runs": 2}})
    desk = CourseDesk(course, Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}"))
    desk.open_accounts()
    return CourseSweeps(desk)


def _sweep(sweeps: CourseSweeps, tmp_path: Path, amount: int, controller: bool = True,
           **data: Any) -> tuple[int, SweepRecord]:
    """A sweep record as the runner writes it; ``controller``: this test process stands for its
    live controller (so the service leaves it to run), else none was ever recorded."""
    record = SweepRecord(tmp_path / "home" / "sweeps" / "s-1").create(
        {"name": "s", "concurrent": 1, "trials_total": 2, "budget": amount / 100, **data})
    if controller:
        record.write(controller=ProcessIdentity.me("sweep-controller").to_dict())
    hold = sweeps.ledger.hold("ana", amount, actor="ana")
    sweeps.ledger.attach_run(hold, record.id, str(record.path), kind="sweep")
    return hold, record


def test_trials_are_charged_as_they_end_and_the_rest_released_at_the_end(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    ledger = sweeps.ledger
    hold, record = _sweep(sweeps, tmp_path, 600)
    record.update_trial(0, run_id="r0", state="succeeded", cost=1.234, released=True)
    record.update_trial(1, run_id="r1", state="running", limit=3.0)
    assert sweeps.settle() == ["r0"]
    assert sweeps.settle() == []  # charged once, however often the service settles
    assert ledger.charged_trials(hold) == {"r0": 124}  # 1.234 CNY: 124 fen, rounded up
    assert ledger.account("ana").balance == 1000 - 600  # the charge came out of the hold
    assert ledger.hold_left(hold) == 476
    record.write(state="cancelled")  # stopped, but trial 1's bill is not in yet: still held
    assert sweeps.settle() == [] and ledger.holds(open_only=True)[0].hold_id == hold
    record.update_trial(1, state="cancelled", cost=0.5, released=True)
    assert sweeps.settle() == ["r1", "s-1"]
    account = ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (174, 0, 826)
    view = sweeps.view("ana", "s-1")
    assert view["settled"] and view["charged"] == 174 and view["state"] == "cancelled"
    assert [t["charge"] for t in view["trials"]] == [124, 50]
    [own] = sweeps.desk.me("ana")["runs"]  # what the lab panel lists: the trials' charges
    assert (own["kind"], own["run"], own["hold"], own["charge"]) == ("sweep", "s-1", 600, 174)


def test_a_trial_that_never_started_costs_nothing(sweeps: CourseSweeps, tmp_path: Path) -> None:
    hold, record = _sweep(sweeps, tmp_path, 300)
    record.update_trial(0, run_id="r0", state="succeeded", cost=0.2, released=True)
    record.update_trial(1, state="skipped", cost=0.0, released=True)  # the budget was spent
    record.write(state="budget_stopped")
    sweeps.settle()
    assert sweeps.ledger.balance("ana") == 1000 - 20


def test_another_student_cannot_see_or_stop_a_sweep_an_instructor_can_see(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    _sweep(sweeps, tmp_path, 300)
    for call in (sweeps.view, sweeps.stop):
        with pytest.raises(CourseError, match="not ben's"):
            call("ben", "s-1")
    assert sweeps.sweeps("ben") == []
    assert [v["sweep"] for v in sweeps.sweeps("teacher")] == ["s-1"]
    with pytest.raises(RunNotFoundError):
        sweeps.view("ana", "no-such-sweep")


@pytest.mark.parametrize(("space", "options", "match"), [
    ({"resources.processes_per_node": [1, 2]}, {}, "the course sets resources"),
    ({"budget.price_per_cpu_core_hour": [1.0]}, {}, "the course sets budget"),
    ({"train.lr": {"low": 1e-4, "high": 1e-3}}, {"strategy": "random", "trials": 2},
     "give budget=N"),
    ({"train.lr": [1e-3]}, {"budget": -1}, "positive amount"),
    ({"train.lr": [1e-3]}, {"controller": "mine"}, "not \\['controller'\\]"),
    ({"train.lr": [1e-3]}, {"concurrent": 3}, "allows 2 at once"),
])
def test_a_sweep_the_course_cannot_hold_is_refused_before_anything_is_written(
        sweeps: CourseSweeps, tmp_path: Path, space: dict, options: dict, match: str) -> None:
    with pytest.raises(CourseError, match=match):
        sweeps.start("ana", {"train": {"max_steps": 2}}, space, options)
    assert sweeps.ledger.entries("ana")[-1]["kind"] == "credit"
    assert not (tmp_path / "home" / "sweeps").exists()


def test_a_budget_past_the_credit_is_refused_before_anything_is_written(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    with pytest.raises(InsufficientCreditError, match="nothing was started"):
        # A range: nothing to quote, so the budget asked is what would be held.
        sweeps.start("ana", {"train": {"max_steps": 2}}, {"train.lr": {"low": 1e-4, "high": 1e-3}},
                     {"strategy": "random", "trials": 2, "budget": 10.01})
    assert [e["kind"] for e in sweeps.ledger.entries("ana")] == ["credit"]
    assert not (tmp_path / "home" / "sweeps").exists()


def test_an_instructor_stops_a_students_sweep_and_the_rest_is_released(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """A sweep whose controller is gone (none recorded here) before any trial ran: the
    instructor's stop marks it cancelled, and the next settle releases the whole hold. (Trials
    with runs are stopped by the sweep's own cancel, tests/test_sweep.py.)"""
    _sweep(sweeps, tmp_path, 500, controller=False)
    assert sweeps.ledger.balance("ana") == 500
    assert sweeps.stop("teacher", "s-1") == {"sweep": "s-1", "state": "cancelled"}
    assert sweeps.settle() == ["s-1"]
    account = sweeps.ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (0, 0, 1000)


def test_a_sweep_the_service_cannot_resume_is_ended_charged_and_released(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    """Its controller gone and its spec no longer valid (a field this version does not know):
    the service does not start a controller that would die at once, it ends the sweep, charges
    the trial that ran and releases the rest, and the sweep's status says why. (The resume of a
    sweep that can go on is tests/course/test_course.py's, with a real killed controller.)"""
    hold, record = _sweep(sweeps, tmp_path, 600, controller=False,
                          spec={"name": "s", "train": {"no_such_knob": 1}},
                          space={"train.lr": {"choices": [1e-3, 2e-3]}})
    record.update_trial(0, run_id="r0", state="succeeded", cost=0.3, released=True)
    record.update_trial(1, run_id="r-never-registered", state="launching", limit=3.0)
    assert sweeps.settle() == ["r0", "r-never-registered", "s-1"]
    data = record.read()
    assert data["state"] == "failed" and "no longer valid" in data["error"]
    assert "controller" not in data  # no controller was started for it
    account = sweeps.ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (30, 0, 970)
    view = sweeps.view("ana", "s-1")
    assert view["settled"] and view["state"] == "failed"
    assert "no_such_knob" in view["error"] and "ended by the course service" in view["error"]
    assert sweeps.settle() == []


def test_a_sweep_whose_folder_is_gone_is_ended_and_its_hold_released(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    hold, record = _sweep(sweeps, tmp_path, 400)
    record.update_trial(0, run_id="r0", state="succeeded", cost=0.25, released=True)
    assert sweeps.settle() == ["r0"]
    shutil.rmtree(record.path)
    assert sweeps.settle() == ["s-1"]
    account = sweeps.ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (25, 0, 975)
    view = sweeps.view("ana", "s-1")
    assert view["settled"] and "is gone" in view["note"] and view["charged"] == 25


def _valid(space: dict[str, Any]) -> dict[str, Any]:
    """A spec and space as workbench.sweep() records them."""
    from workbench.spec import RunSpec
    from workbench.sweep.space import parse_space

    base = RunSpec.coerce({"name": "s"})
    return {"spec": base.model_dump(mode="json"),
            "space": {p.path: p.to_dict() for p in parse_space(space, base)}}


def test_a_sweep_whose_controller_keeps_dying_is_ended_not_resumed_forever(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    hold, record = _sweep(sweeps, tmp_path, 300, controller=False, service_resumes=3,
                          **_valid({"train.lr": [1e-3, 2e-3]}))
    assert sweeps.settle() == ["s-1"]
    data = record.read()
    assert data["state"] == "failed" and "after 3 resumes" in data["error"]
    assert "controller" not in data and sweeps.ledger.balance("ana") == 1000


def test_a_sweep_being_stopped_when_its_controller_died_is_cancelled_not_resumed(
        sweeps: CourseSweeps, tmp_path: Path) -> None:
    hold, record = _sweep(sweeps, tmp_path, 300, controller=False,
                          **_valid({"train.lr": [1e-3, 2e-3]}))
    record.update_trial(0, run_id="r0", state="succeeded", cost=0.5, released=True)
    record.write(stop_request="cancel")
    assert sweeps.settle() == ["r0", "s-1"]
    data = record.read()
    assert data["state"] == "cancelled" and "controller" not in data
    assert sweeps.ledger.balance("ana") == 1000 - 50
