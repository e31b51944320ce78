"""An evaluation through the course is held and charged at the rate of where it runs: the run's
own GPUs on its target, else one CPU core, by the course's price table. Real ledger, real run
records in a real student's space and the real worker, run as that student through sudo; no run
here has weights, so the evaluation fails at once after its hold was taken: what is checked is
that hold, its charge and the rate the student is told. No mock."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from workbench.course.desk import CourseDesk
from workbench.course.students import ensure_space
from workbench.errors import CourseError
from workbench.runs.ledger import Ledger
from workbench.runs.registry import Registry, RunRecord
from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec


@pytest.fixture
def desk(tmp_path: Path, classroom: dict) -> CourseDesk:
    # A card-hour 30 CNY, a core-hour 36: an evaluation's 2 minutes hold 1.00 or 1.20 CNY.
    course = classroom["course"](
        default_credit=10, hardware={"local": "H100"},
        prices={"cpu_core_hour": 36, "gpu_hour": {"H100": 30}},
        caps={"gpus_per_run": 2, "eval_minutes": 2})
    d = CourseDesk(course, Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}"))
    d.open_accounts()
    return d


def _ended_run(desk: CourseDesk, student: str, run_id: str, resources: dict) -> None:
    """A run of the student's that ended (as a launch through the desk leaves it), without
    training: in their space, registered in their registry, every file theirs."""
    home = ensure_space(desk.course, student) / "workbench"
    spec = RunSpec.coerce({"name": run_id, "resources": resources})
    rd = RunDir(home / "runs" / run_id).create(spec)
    rd.write_status(state="succeeded", ended=time.time(), released=time.time(), cost=0.0)
    now = time.time()
    Registry(home / "registry.sqlite").add_run(RunRecord(
        id=run_id, name=run_id, target="local", backend_job_id=None, run_dir=str(rd.path),
        state="succeeded", created=now, updated=now))
    subprocess.run(["chown", "-R", f"{student}:", str(home)], check=True)
    hold = desk.ledger.hold(student, 10, actor=student)
    desk.ledger.attach_run(hold, run_id, str(rd.path))
    desk.ledger.settle(hold, 0, actor="test")


@pytest.mark.parametrize(("resources", "held", "rate"), [
    ({"gpus_per_node": 2, "gpu_type": "H100", "processes_per_node": 2, "nodes": 1}, 200,
     "60.00 CNY an hour (2 x H100 on local)"),
    ({"processes_per_node": 2}, 120, "36.00 CNY an hour (one CPU core on local)"),
])
def test_an_evaluation_is_held_at_the_rate_of_the_runs_own_resources(
        desk: CourseDesk, classroom: dict, resources: dict, held: int, rate: str) -> None:
    ana = classroom["users"]["ana"]
    _ended_run(desk, ana, "r1", resources)
    with pytest.raises(CourseError, match="evaluating r1 failed") as failed:
        desk.evaluate(ana, "r1", ["heldout"], {})
    [h] = [h for h in desk.ledger.holds(ana) if h.kind == "evaluate"]
    assert h.amount == held and h.charge is not None and 0 <= h.charge <= held
    assert desk.ledger.balance(ana) == 1000 - h.charge
    assert f"at {rate}" in str(failed.value)  # the student is told the rate
