"""An evaluation through the course is held and charged at the rate of where it runs: the run's
own GPUs on its target, else one CPU core, by the course's price table. Real ledger, real run
records and the service's real `workbench eval` subprocess; no GPU runs here, so the GPU run's
evaluation fails at once (it has no weights) after its hold was taken: what is checked is that
hold, its charge and the rate the student is told. No mock."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from workbench.course.config import Course
from workbench.course.desk import CourseDesk
from workbench.course.ledger import Ledger
from workbench.errors import CourseError
from workbench.registry import Registry, RunRecord
from workbench.rundir import RunDir
from workbench.spec import RunSpec


@pytest.fixture
def desk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CourseDesk:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    course = Course.model_validate({
        "name": "evals", "instructors": ["teacher"], "students": ["ana"], "default_credit": 10,
        "state_dir": str(tmp_path / "state"),
        # A card-hour 30 CNY, a core-hour 36: an evaluation's 2 minutes hold 1.00 or 1.20 CNY.
        "prices": {"cpu_core_hour": 36, "gpu_hour": {"H100": 30}},
        "caps": {"gpus_per_run": 2, "eval_minutes": 2}})
    d = CourseDesk(course, Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}"))
    d.open_accounts()
    return d


def _ended_run(desk: CourseDesk, tmp_path: Path, run_id: str, resources: dict) -> None:
    """A run of ana's that ended (as a launch through the desk leaves it), without training."""
    spec = RunSpec.coerce({"name": run_id, "resources": resources})
    rd = RunDir(tmp_path / "home" / "runs" / run_id).create(spec)
    rd.write_status(state="succeeded", ended=time.time(), released=time.time(), cost=0.0)
    now = time.time()
    Registry().add_run(RunRecord(id=run_id, name=run_id, target="local", backend_job_id=None,
                                 run_dir=str(rd.path), state="succeeded", created=now,
                                 updated=now))
    hold = desk.ledger.hold("ana", 10, actor="ana")
    desk.ledger.attach_run(hold, run_id, str(rd.path))
    desk.ledger.settle(hold, 0, actor="test")


@pytest.mark.parametrize(("resources", "held", "rate"), [
    ({"gpus_per_node": 2, "gpu_type": "H100", "processes_per_node": 2, "nodes": 1}, 200,
     "60.00 CNY an hour (2 x H100 on local)"),
    ({"processes_per_node": 2}, 120, "36.00 CNY an hour (one CPU core on local)"),
])
def test_an_evaluation_is_held_at_the_rate_of_the_runs_own_resources(
        desk: CourseDesk, tmp_path: Path, resources: dict, held: int, rate: str) -> None:
    _ended_run(desk, tmp_path, "r1", resources)
    with pytest.raises(CourseError, match="evaluating r1 failed") as failed:
        desk.evaluate("ana", "r1", ["heldout"], {})
    [h] = [h for h in desk.ledger.holds("ana") if h.kind == "evaluate"]
    assert h.amount == held and h.charge is not None and 0 <= h.charge <= held
    assert desk.ledger.balance("ana") == 1000 - h.charge
    assert f"at {rate}" in str(failed.value)  # the student is told the rate
