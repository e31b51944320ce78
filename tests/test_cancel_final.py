"""A cancel is final: pressed while a launch prepares its run, or while a resume hands the run
to its target, it ends the run, nothing of the run starts after it, and nothing is billed.

How these tests hold the run in its window without racing the machine: real locks and waits of
the launch and resume paths, never a sleep. A launch is held right after it created its run
directory by a write transaction on the registry (its registration waits), so the test takes the
run's attempt lock, which whoever hands a run to its target holds; released, the launch prepares
the data and waits there, pending, while the test cancels from a handle found in the registry.
A resume is held in its wait for the previous attempt's processes to exit (one of them is a
process the test keeps alive), which it does while holding the attempt lock.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

import workbench
from tests.waiting import wait_for
from workbench.runs import procs
from workbench.runs.home import runs_dir
from workbench.runs.registry import Registry
from workbench.runs.rundir import RunDir

pytestmark = pytest.mark.slow


class _InThread:
    """``fn()`` in a thread: its result, or its exception re-raised, by :meth:`result`."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # handed to the test by result()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"still running after {timeout:.0f} s"
        if self.error is not None:
            raise self.error
        return self.value


def _held_here(lock_file: Path) -> bool:
    """Does a process of this test hold the flock on ``lock_file`` (Linux: /proc/locks)?"""
    st = os.stat(lock_file)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with open("/proc/locks", encoding="ascii") as fh:
        return any("->" not in line and where in line and f" {os.getpid()} " in line
                   for line in fh)


def _alive_of(markers: list[str]) -> list[str]:
    """Command lines of live processes that name any of ``markers`` (a run directory, or the
    standby folder whose ranks name it instead)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        line = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(m in line for m in markers):
            found.append(line)
    return found


def _standby_folders(since: float) -> list[str]:
    """The folders of the standbys this test process started after ``since``
    (``python -m workbench.runs.standby FOLDER N``)."""
    folders = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd, started = p.cmdline(), p.create_time()
        except psutil.NoSuchProcess:
            continue
        if "workbench.runs.standby" in cmd and started >= since - 1.0:
            folders.append(cmd[cmd.index("workbench.runs.standby") + 1])
    return folders


def _cancelled_while_preparing(registry: Registry, name: str) -> dict[str, Any]:
    """Launch ``name`` and cancel it, from a handle the registry gives, while the launch still
    prepares it (nothing submitted yet). The run's state then, what the cancel answered, what
    the launch returned, and the markers of every process the launch had started by then."""
    before, since = set(runs_dir().glob(f"{name}-*")), time.time()
    gate = sqlite3.connect(registry.path, isolation_level=None, timeout=30)
    gate.execute("BEGIN IMMEDIATE")  # the launch's registration waits for this transaction
    launch = _InThread(lambda: workbench.launch(
        {"name": name, "train": {"max_steps": 3, "log_every": 1}}, registry=registry))
    try:
        path = wait_for(lambda: next(iter(set(runs_dir().glob(f"{name}-*")) - before), None),
                        120, "the launch to create its run directory")
        rd = RunDir(path)
        with rd.attempt_lock() as free:  # nothing else holds a new run's lock yet
            assert free
            gate.execute("ROLLBACK")
            job = wait_for(lambda: _registered(registry, path.name), 120,
                           "the launch to register its run")
            state = rd.status()["state"]
            markers = [str(path), *_standby_folders(since)]
            # The test holds the attempt lock, so the cancel's wait for the hand-over can only
            # run out: a short one.
            answer = job.cancel(timeout=1)
    finally:
        gate.close()
    return {"state": state, "answer": answer, "job": launch.result(300), "markers": markers,
            "rd": rd}


def _registered(registry: Registry, run_id: str) -> Any:
    ids = {r.id for r in registry.list_runs()}
    return workbench.get_job(run_id, registry=registry) if run_id in ids else None


def _stop_if_running(job: Any) -> None:
    if job is not None and not job.done:
        job.cancel(timeout=60)


def test_a_cancel_while_the_launch_prepares_the_data_ends_the_run_before_it_starts(registry):
    got = _cancelled_while_preparing(registry, "cancel-preparing")
    job, rd = got["job"], got["rd"]
    try:
        assert got["state"] == "pending" and got["answer"] == "cancelled"
        assert job.id == rd.path.name and job.state == "cancelled"
        assert registry.get_run(job.id).state == "cancelled"
        status = rd.status()
        assert status["state"] == "cancelled" and status["cancel_requested"] <= status["ended"]
        assert status.get("processes", []) == []  # no supervisor was ever recorded, or started
        assert status.get("cost", 0.0) == 0.0 and status.get("billed_s", 0.0) == 0.0
        assert rd.metrics() == []  # no step was trained, nothing was logged
        assert not (rd.logs_dir / "supervisor.log").exists()
        # The standby's supervisor and ranks, started before the cancel, are gone with it.
        assert _alive_of(got["markers"]) == []
        assert job.wait(timeout=60, progress=False) == "cancelled"
    finally:
        _stop_if_running(job)


def test_a_cancel_while_a_resume_starts_the_run_keeps_it_ended(registry):
    got = _cancelled_while_preparing(registry, "cancel-resume")
    job = got["job"]
    try:
        ended = job.wait(timeout=600, progress=False)
        rd = job.run_dir
        before = rd.status()
        lines = len(rd.metrics())
        # A process of the ended attempt that is still exiting: a resume waits for it, holding
        # the attempt lock, until it is gone.
        straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        procs.record(rd, procs.ProcessIdentity.of(straggler.pid, "rank", 1))
        recorded = rd.status()["processes"]
        try:
            resume = _InThread(job.resume)
            wait_for(lambda: _held_here(rd.path / ".attempt.lock"), 60,
                     "the resume to hold the run's attempt lock")
            other = workbench.get_job(job.id, registry=registry)
            # The resume holds the lock until the straggler is gone, which is after this call:
            # the cancel's wait for the hand-over can only run out, so a short one.
            assert other.cancel(timeout=1) == ended
        finally:
            straggler.kill()
            straggler.wait()
        resumed = resume.result(120)
        assert resumed.state == ended
        status = rd.status()
        assert status["state"] == ended and status.get("attempt") == before.get("attempt")
        assert status["cancel_requested"] > before.get("ended", 0.0)
        # Nothing started: no process recorded, no new metrics lines, nothing more billed.
        assert status["processes"] == recorded
        assert len(rd.metrics()) == lines
        assert status.get("cost", 0.0) == before.get("cost", 0.0)
        assert _alive_of([str(rd.path)]) == []
        assert registry.get_run(job.id).state == ended
    finally:
        _stop_if_running(job)
