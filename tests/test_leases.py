"""GPU leases for local runs (issue 16, item 3): disjoint devices, dead holders' devices reclaimed.

No GPU here: the device pool is a parameter (or ``CUDA_VISIBLE_DEVICES``, which the lease module
reads before asking torch), never a patch of torch. Holders are real processes (``sleep``), so
liveness is judged the way it is for a real run: by PID and start time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.errors import ResourceError, SpecError
from workbench.runs.procs import ProcessIdentity
from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec
from workbench.targets import leases

EIGHT = [str(i) for i in range(8)]


@pytest.fixture
def sleeper():
    started: list[subprocess.Popen] = []

    def start() -> ProcessIdentity:
        proc = subprocess.Popen(["sleep", "600"])
        started.append(proc)
        return ProcessIdentity.of(proc.pid, "supervisor")

    yield start, started
    for proc in started:
        proc.kill()
        proc.wait()


def test_two_one_gpu_runs_on_an_eight_gpu_node_get_different_cards(tmp_path, sleeper):
    start, _ = sleeper
    a = leases.acquire("run-a", 1, start(), devices=EIGHT, root=tmp_path)
    b = leases.acquire("run-b", 1, start(), devices=EIGHT, root=tmp_path)
    c = leases.acquire("run-c", 4, start(), devices=EIGHT, root=tmp_path)
    assert a == ["0"]
    assert b != a and len(b) == 1
    assert len(c) == 4 and not set(c) & set(a + b)


def test_a_live_holder_is_respected_and_a_dead_ones_cards_are_reclaimed(tmp_path, sleeper):
    start, procs = sleeper
    leases.acquire("run-a", 2, start(), devices=["0", "1"], root=tmp_path)
    with pytest.raises(ResourceError, match=r"run-a holds GPU 0,1 \(supervisor \(pid \d+"):
        leases.acquire("run-b", 1, start(), devices=["0", "1"], root=tmp_path)
    with pytest.raises(ResourceError, match="0 of 2"):
        leases.check_free("run-b", 1, ["0", "1"], root=tmp_path)
    procs[0].kill()
    procs[0].wait()  # run-a's supervisor is gone (as after kill -9): its cards are free again
    assert leases.acquire("run-b", 2, start(), devices=["0", "1"], root=tmp_path) == ["0", "1"]
    assert [le.owner for le in leases.held(tmp_path)] == ["run-b"]


def test_a_reused_pid_does_not_keep_a_lease(tmp_path, sleeper):
    start, _ = sleeper
    live = start()
    # Same PID as a live process, another start time: the process that took the lease is gone.
    ghost = ProcessIdentity(live.host, live.pid, live.create_time - 1000.0, "supervisor")
    leases.acquire("run-old", 1, ghost, devices=["0"], root=tmp_path)
    assert leases.acquire("run-new", 1, live, devices=["0"], root=tmp_path) == ["0"]


def test_release_frees_only_the_holders_own_lease(tmp_path, sleeper):
    start, _ = sleeper
    first, second = start(), start()
    leases.acquire("run-a", 1, first, devices=["0", "1"], root=tmp_path)
    assert not leases.release("run-a", second, root=tmp_path)  # e.g. a later attempt's holder
    leases.check_free("run-b", 1, ["0", "1"], root=tmp_path)
    assert leases.release("run-a", first, root=tmp_path)
    assert leases.acquire("run-b", 2, second, devices=["0", "1"], root=tmp_path) == ["0", "1"]


def test_more_cards_than_the_machine_shows_says_so(tmp_path, sleeper):
    start, _ = sleeper
    with pytest.raises(ResourceError, match="shows 2 CUDA device.*at most 2"):
        leases.acquire("run-a", 3, start(), devices=["0", "1"], root=tmp_path)
    assert leases.held(tmp_path) == []


def test_the_pool_is_the_cards_this_process_may_see(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert leases.visible_devices() == ["2", "5"]


def test_more_processes_than_gpus_is_a_spec_error():
    with pytest.raises(SpecError, match="processes_per_node .*at most gpus_per_node"):
        RunSpec.parse({"resources": {"gpus_per_node": 1, "processes_per_node": 2}})
    RunSpec.parse({"resources": {"gpus_per_node": 0, "processes_per_node": 2}})  # CPU: fine
    RunSpec.parse({"resources": {"gpus_per_node": 8, "processes_per_node": 1}})


def _supervise(run_dir: Path, visible: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    env.pop("SLURM_JOB_ID", None)
    subprocess.run([sys.executable, "-m", "workbench.runs.supervise", str(run_dir)],
                   check=False, timeout=300, env=env)


def test_the_supervisor_leases_records_and_releases_its_cards(tmp_path, wb_home, sleeper):
    """The supervisor for real, with two "cards" named by CUDA_VISIBLE_DEVICES (no GPU here:
    the ranks it starts fail at once on the data they lack, which is enough to see the lease
    taken before them and given back after them)."""
    start, _ = sleeper
    other = start()
    leases.acquire("someone-else", 1, other, devices=["0", "1"])
    spec = RunSpec.parse({"name": "leased", "resources": {"gpus_per_node": 1},
                          "train": {"max_steps": 1}})
    rd = RunDir(tmp_path / "leased").create(spec)
    _supervise(rd.path, "0,1")
    status = rd.status()
    assert status["gpus"] == ["1"]  # the free card, not cuda:0 that the other run holds
    assert status["state"] == "failed" and status.get("released")
    assert [le.owner for le in leases.held()] == ["someone-else"]  # ours given back

    # Both cards taken: the supervisor starts nothing and says who holds them.
    leases.acquire("third", 1, start(), devices=["0", "1"])
    rd2 = RunDir(tmp_path / "leased2").create(spec)
    _supervise(rd2.path, "0,1")
    status = rd2.status()
    assert status["state"] == "failed" and "gpus" not in status
    assert "someone-else holds GPU 0" in status["error"] and "third holds GPU 1" in status["error"]
    assert not (rd2.logs_dir / "launcher.log").exists()  # torchrun never started


def test_two_homes_on_one_machine_lease_from_the_same_cards(tmp_path, sleeper, monkeypatch):
    """The leases are the machine's: a run of another WORKBENCH_HOME (another user, a course's
    student) holds its card against this home's runs, and a run of the same name in each home
    holds apart."""
    start, _ = sleeper
    monkeypatch.setenv("WORKBENCH_LEASES", str(tmp_path / "machine"))
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "ana"))
    assert leases.acquire("quickstart", 1, start(), devices=["0", "1"]) == ["0"]
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "ben"))
    assert leases.acquire("quickstart", 1, start(), devices=["0", "1"]) == ["1"]
    with pytest.raises(ResourceError, match=f"quickstart holds GPU 0 .*of {tmp_path / 'ana'}"):
        leases.acquire("other", 1, start(), devices=["0", "1"])
    folder = tmp_path / "machine" / leases.hostname()
    assert oct(folder.stat().st_mode & 0o7777) == "0o1777"  # every user may lease, sticky


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a file of another user (root chowns it)")
def test_a_lease_written_in_another_users_name_holds_nothing(tmp_path, sleeper, monkeypatch):
    start, _ = sleeper
    monkeypatch.setenv("WORKBENCH_LEASES", str(tmp_path / "machine"))
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    leases.acquire("hog", 2, start(), devices=["0", "1"])  # held by this (root's) sleep
    folder = tmp_path / "machine" / leases.hostname()
    for f in folder.glob("hog.*.json"):
        os.chown(f, 65534, -1)  # as if nobody had written it, naming root's process
    assert leases.acquire("mine", 2, start(), devices=["0", "1"]) == ["0", "1"]
