"""Bad inputs and rough handling a user really gives, each through the entry point they use.

A negative budget (spec, resume, CLI), two launches of one name at the same moment while the
usual rendezvous ports are taken, and the ranks' launcher (workbench.runs.launcher, torchrun's stand-in on
one node) killed with -9 mid-run. Real runs: the built-in
tiny model in 2 gloo processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

import workbench
from tests.waiting import wait_for
from workbench.cli import main
from workbench.errors import SpecError
from workbench.runs.home import runs_dir
from workbench.runs.registry import Registry
from workbench.train.callbacks import HOLD_ENV

_wait_for = wait_for


# -- a negative budget -----------------------------------------------------------------------------
def test_a_negative_budget_in_a_spec_is_refused_before_anything_is_written(tmp_path, capsys):
    before = (set(runs_dir().iterdir()), [r.id for r in Registry().list_runs()])
    spec = {"name": "minus", "budget": {"limit": -1, "price_per_cpu_core_hour": 1.0}}
    for entry in (workbench.launch, workbench.plan):
        with pytest.raises(SpecError, match=r"budget\.limit.*greater than 0"):
            entry(spec)
    path = tmp_path / "minus.yaml"
    path.write_text("name: minus\nbudget: {limit: -1, price_per_cpu_core_hour: 1.0}\n")
    assert main(["launch", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "budget.limit" in err and "Traceback" not in err, err
    assert (set(runs_dir().iterdir()), [r.id for r in Registry().list_runs()]) == before


@pytest.mark.slow
def test_a_negative_budget_on_resume_is_refused_and_nothing_is_recorded(finished_job, capsys):
    job = finished_job
    status = job.status()
    with pytest.raises(SpecError, match=r"budget\.limit.*greater than 0"):
        job.resume(**{"budget.limit": -1})
    assert main(["resume", job.id, "--budget", "-1"]) == 1
    err = capsys.readouterr().err
    assert "budget.limit" in err and "Traceback" not in err, err
    assert not job.run_dir.resume_file.exists()  # nothing recorded for a refused resume
    after = job.status()
    assert after["state"] == "succeeded" and after["attempt_started"] == status["attempt_started"]


# -- two launches of one name at once ------------------------------------------------------------
@pytest.mark.slow
def test_two_launches_of_one_name_at_once_get_their_own_run_directories(monkeypatch):
    import workbench.runs.launching as launching

    # Two launches in the same second draw ids from a 4-hex-digit random part; make the bad luck
    # certain: both are first offered the same id (the real generator after that).
    real = launching._new_run_id
    offered: list[str] = []
    lock = threading.Lock()

    def unlucky(name: str) -> str:
        with lock:
            offered.append(name)
            return f"{name}-20260101-000000-beef" if len(offered) <= 2 else real(name)

    monkeypatch.setattr(launching, "_new_run_id", unlucky)
    # torchrun's usual rendezvous ports are taken by someone else: a single-node run must not
    # need either of them.
    held = []
    for port in (29400, 29500):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:  # already taken by another process: just as good for this test
            s.close()
    spec = {"name": "twin", "train": {"max_steps": 2, "log_every": 1},
            "data": {"validation_fraction": 0.0}}
    start = threading.Barrier(2)
    results: list[object] = [None, None]

    def go(i: int) -> None:
        start.wait()
        try:
            results[i] = workbench.launch(spec)
        except Exception as exc:  # kept for the assertion message
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        jobs = [r for r in results if isinstance(r, workbench.Job)]
        assert len(jobs) == 2, results
        assert jobs[0].id != jobs[1].id and jobs[0].run_dir.path != jobs[1].run_dir.path
        for job in jobs:
            assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
            assert [m["step"] for m in job.metrics() if "loss" in m] == [1, 2]
            assert job.run_dir.spec().name == "twin"
    finally:
        for s in held:
            s.close()
    names = {r.id: r.name for r in Registry().list_runs()}
    assert all(names[j.id] == "twin" for j in jobs)
    assert workbench.get_job("twin").id in {j.id for j in jobs}  # the newest of that name


# -- the ranks' launcher killed with -9 --------------------------------------------------------------
def _rank_pids(job) -> dict[int, int]:
    pids = {}
    for rank in (0, 1):
        log = job.run_dir.logs_dir / f"rank-{rank}.log"
        found = re.findall(rf"rank {rank}/2 pid (\d+)", log.read_text()) if log.is_file() else []
        if found:
            pids[rank] = int(found[-1])
    return pids


@pytest.mark.slow
def test_launcher_killed_with_sigkill_restarts_from_the_snapshot_and_says_why(tmp_path,
                                                                              monkeypatch):
    # The run holds after step 2 (a hold file: HOLD_ENV) until the kill, so the kill lands
    # right after the first snapshot on a machine of any speed (a kill after the last snapshot
    # resumes at the final step: see the note).
    hold = tmp_path / "hold"
    hold.write_text("2")
    monkeypatch.setenv(HOLD_ENV, str(hold))
    try:
        job = workbench.launch({"name": "kill-launcher",
                                "train": {"max_steps": 40, "log_every": 1},
                                "data": {"validation_fraction": 0.0},
                                "checkpoint": {"every_steps": 2}})
        _wait_for(lambda: (job.status().get("snapshot") or {}).get("step"), 300,
                  "a first snapshot")
        status = job.status()
        launcher = psutil.Process(status["launcher_pid"])
        # The process that spawns the ranks on one node (it replaced torchrun there).
        assert "workbench.runs.launcher" in " ".join(launcher.cmdline())
        # This run's launcher by identity, not a reused pid: the one its attempt recorded. (Its
        # command line names a standby folder, not the run dir, when the standby started it.)
        recorded = [p for p in status["processes"] if p["role"] == "launcher"]
        assert [(p["pid"], p["create_time"]) for p in recorded] == [
            (launcher.pid, launcher.create_time())]
        old = {r: psutil.Process(p) for r, p in _rank_pids(job).items()}
        assert len(old) == 2
        launcher.send_signal(signal.SIGKILL)
    finally:
        hold.unlink()  # the restarted ranks (seconds later) train on through
    # The ranks of the killed launcher are stopped (they would otherwise train on beside the
    # restarted ones).
    _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                              for p in old.values()), 120, "the old ranks to end")
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    final = job.status()
    assert final["restarts"] == 1 and final["step"] == 40
    assert "the launcher of the ranks was killed by SIGKILL" in final["last_error"], final
    assert set(_rank_pids(job).values()).isdisjoint(p.pid for p in old.values())
    steps = [m["step"] for m in job.metrics() if "loss" in m]
    assert steps[-1] == 40 and steps == sorted(steps)
    assert Path(job.artefact(), "adapter_model.safetensors").is_file()


# -- checkpoint storage that cannot be used ---------------------------------------------------------
@contextlib.contextmanager
def _moto_server(enforce_auth: bool):
    """A real S3 endpoint on loopback (moto's server in its own process); with ``enforce_auth``
    it checks credentials against its IAM, which knows none, as a real endpoint refuses wrong ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0" if enforce_auth else "inf"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _listening(port), 60, "the moto server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("enforce_auth, fragment", [
    (False, r"the bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1:\d+; create it"),
    (True, r"access refused \(The AWS Access Key Id you provided does not exist.*set credentials"),
], ids=["missing-bucket", "bad-credentials"])
def test_unusable_s3_storage_is_refused_at_launch_before_anything_is_written(
        enforce_auth, fragment, monkeypatch):
    from workbench.runs.snapshots import StorageError

    with _moto_server(enforce_auth) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        before = (set(runs_dir().iterdir()), [r.id for r in Registry().list_runs()])
        with pytest.raises(StorageError, match=fragment) as info:
            workbench.launch({"name": "s3-bad", "train": {"max_steps": 2},
                              "checkpoint": {"every_steps": 1,
                                             "storage": "s3://no-such-bucket/wb"}})
        assert isinstance(info.value, workbench.WorkbenchError)
        assert "wrong" not in str(info.value)  # the secret is not echoed back
        assert (set(runs_dir().iterdir()), [r.id for r in Registry().list_runs()]) == before
