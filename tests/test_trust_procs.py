"""Who is running a run, told by process identity: stale handles, kill -9, PID reuse, root causes.

The run tests start real supervisors, torchrun and 2 gloo ranks on the built-in tiny model, with a
large max_steps so that each run lives until the test cancels or kills it. Liveness is checked
with psutil against the identities (pid + create time) that the run recorded in status.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import workbench
from workbench.errors import RunBusyError, SpecError
from workbench.runs.procs import ProcessIdentity, of_attempt
from workbench.runs.rundir import RunDir, write_text_atomic
from workbench.spec import RunSpec
from workbench.targets.backends.local import LocalBackend

LONG = {"train": {"max_steps": 100000, "log_every": 1}, "data": {"validation_fraction": 0.0}}


def _wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def _attempt(job) -> list[ProcessIdentity]:
    return of_attempt(job.run_dir.status())


def _ranks_started(job, attempt: int) -> bool:
    status = job.run_dir.status()
    roles = [p.role for p in of_attempt(status)]
    return status.get("attempt") == attempt and roles.count("rank") == 2 and "launcher" in roles


def _live(idents: list[ProcessIdentity]) -> list[ProcessIdentity]:
    return [p for p in idents if p.alive()]


def _supervisors(run_dir: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("workbench.runs.supervise" in cmd and str(run_dir) in cmd
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(p)
    return found


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """A failing test (or the old code, which left ranks training) must not load the machine."""
    before = {p.pid for p in psutil.process_iter()}
    yield
    roles = ("workbench.train", "workbench.runs.supervise", "workbench.runs.launcher",
             "torch.distributed.run")
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        # Only runs under this session's WORKBENCH_HOME: other sessions' runs are not ours.
        if p.pid not in before and os.environ["WORKBENCH_HOME"] in cmd and any(
                r in cmd for r in roles):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


# -- identities, without training --------------------------------------------------------------
def test_a_reused_pid_is_judged_dead_and_never_signalled(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        real = ProcessIdentity.of(sleeper.pid, "supervisor")
        assert real.alive()
        # What a record of an earlier process looks like once the kernel gave its PID to `sleep`.
        reused = dataclasses.replace(real, create_time=real.create_time - 1000.0)
        assert not reused.alive()
        assert reused.signal(signal.SIGKILL) is False
        rd = RunDir(tmp_path / "run").create(RunSpec())
        rd.write_status(state="running", attempt=1, processes=[reused.to_dict()])
        # The job id names the PID as well: the old code signalled it.
        LocalBackend().cancel(rd.path, f"local:{sleeper.pid}", timeout=3)
        assert rd.status()["state"] == "cancelled"  # nothing of the run is alive: known
        with pytest.raises(subprocess.TimeoutExpired):  # had it been signalled, it would end
            sleeper.wait(timeout=1.0)
        assert real.alive()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not real.alive()  # ended (and reaped): the same identity is now dead


def test_a_wall_clock_adjustment_does_not_make_a_live_process_look_gone(monkeypatch):
    # psutil reports a create time as the boot time from /proc/stat (whole seconds, read again at
    # every call) plus the process's start ticks. An NTP adjustment moves that boot time by a
    # second: a rank then judged its live supervisor gone and stopped itself (a CI run's
    # in-training evaluation failed so, and a stopped endpoint's server was left running).
    import psutil._pslinux as linux

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        recorded = ProcessIdentity.of(sleeper.pid, "supervisor")
        boot = linux.boot_time()
        monkeypatch.setattr(linux, "boot_time", lambda: boot + 1.0)  # the clock moved on
        assert recorded.alive()
        assert recorded.same(ProcessIdentity.of(sleeper.pid, "supervisor"))
        # A start that differs by other than whole seconds is another process (a reused PID).
        assert not dataclasses.replace(recorded, create_time=recorded.create_time + 0.5).alive()
        assert not dataclasses.replace(recorded, create_time=recorded.create_time - 60.0).alive()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_on_another_host_is_reported_unknown_not_failed(tmp_path):
    rd = RunDir(tmp_path / "run").create(RunSpec())
    far = ProcessIdentity("gpu-node-7", 4242, 1.0e9, "supervisor")
    rd.write_status(state="running", attempt=1, processes=[far.to_dict()])
    status = LocalBackend().status(rd.path, "local:4242")
    assert status["state"] == "running" and "gpu-node-7" in status["warning"]
    assert rd.status()["state"] == "running"
    with pytest.raises(ValueError, match="only that host"):
        far.alive()


def test_a_run_recorded_with_a_bare_pid_only_is_left_as_recorded(tmp_path):
    rd = RunDir(tmp_path / "run").create(RunSpec())
    gone = subprocess.Popen(["true"])
    gone.wait()
    rd.write_status(state="running", supervisor_pid=gone.pid)  # as older versions wrote it
    status = LocalBackend().status(rd.path, f"local:{gone.pid}")
    assert status["state"] == "running" and "unknown" in status["warning"]
    assert rd.status()["state"] == "running"


@pytest.mark.parametrize("field, value", [("name", "name\n"), ("target", "local\n"),
                                          ("target", "slurm:gpu\n")])
def test_names_with_a_trailing_newline_are_refused(field, value):
    with pytest.raises(SpecError, match=field):
        RunSpec.coerce({field: value})


def test_threads_writing_one_file_atomically_never_collide(tmp_path):
    path = tmp_path / "status.json"
    texts = [f"{i}:" + str(i) * 20000 for i in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(texts))

    def write(text: str) -> None:
        start.wait()
        try:
            for _ in range(40):
                write_text_atomic(path, text)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_text() in texts  # whole, never a mix of two writers
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temp file left


# -- real runs ---------------------------------------------------------------------------------
slow = pytest.mark.slow


@slow
def test_a_stale_handle_and_a_kill_9_of_the_supervisor_keep_the_state_true_and_resume_once():
    """One long run, three attempts (each real run costs the suite ~30 s): a cancel and a resume
    through another handle leave a stale handle's state true; a kill -9 of the resumed attempt's
    supervisor ends every rank, and of two concurrent resumes one is refused; the stale handle's
    cancel stops the last attempt."""
    job = workbench.launch({"name": "stale", **LONG})
    _wait_for(lambda: _ranks_started(job, 1), 240, "the first attempt's ranks started")
    stale = workbench.get_job(job.id)  # e.g. the lab panel's handle, kept for the server's life
    assert stale.state == "running"  # the panel's last look before ...
    job.cancel()  # ... a cancel and a resume through another handle, between two of its polls
    job.resume()
    _wait_for(lambda: _ranks_started(job, 2) and job.run_dir.status()["state"] == "running", 240,
              "the resumed attempt is running")
    assert stale.state == "running", stale.status().get("error")
    with pytest.raises(RunBusyError, match="live processes"):
        stale.resume()
    assert len(_supervisors(job.run_dir.path)) == 1

    # kill -9 of the supervisor: the launcher and both ranks end with it.
    second = _attempt(job)
    supervisor = next(p for p in second if p.role == "supervisor")
    os.kill(supervisor.pid, signal.SIGKILL)
    _wait_for(lambda: not _live(second), 30, "the launcher and both ranks ended with the supervisor")
    status = job.status()
    assert status["state"] == "failed", status
    assert "supervisor" in status["error"] and "died" in status["error"]

    handles = [workbench.get_job(job.id) for _ in range(2)]
    outcomes: list[object] = []
    start = threading.Barrier(2)

    def resume(handle) -> None:
        start.wait()
        try:
            outcomes.append(handle.resume())
        except RunBusyError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=resume, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [o for o in outcomes if isinstance(o, RunBusyError)]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    _wait_for(lambda: _ranks_started(job, 3), 240, "the resumed run's ranks started")
    assert len(_supervisors(job.run_dir.path)) == 1
    with pytest.raises(RunBusyError, match="live processes"):
        job.resume()
    third = _attempt(job)
    assert stale.cancel() == "cancelled"
    _wait_for(lambda: not _live(third), 30, "the resumed attempt's processes ended")
    assert job.state == "cancelled"


@slow
def test_the_error_is_the_root_cause_of_this_attempt():
    job = workbench.launch({"name": "raiser", "method": {"target_modules": ["no_such_proj"]},
                            "train": {"max_steps": 5}})
    assert job.wait(timeout=300, progress=False) == "failed"
    error = job.status()["error"]
    assert "no_such_proj" in error and "rank-" in error and "ChildFailedError" not in error
    with pytest.raises(workbench.JobFailedError, match="no_such_proj"):
        job.wait(raise_on_failure=True, progress=False)
    # The second attempt fails otherwise, in rank 1 only: its log path is taken by a folder.
    logs = job.run_dir.logs_dir
    (logs / "rank-1.log").rename(logs / "rank-1.first-attempt")
    (logs / "rank-1.log").mkdir()
    job.resume()
    assert job.wait(timeout=300, progress=False) == "failed"
    error = job.status()["error"]
    assert "IsADirectoryError" in error and "rank-1.log" in error, error
    assert "no_such_proj" not in error
