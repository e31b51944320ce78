"""A sweep's own record: its directory under WORKBENCH_HOME/sweeps and ``sweep.json`` in it.

    SWEEP_DIR/sweep.json      what was asked (spec, space, strategy, objective, budget, ...), the
                              controller's identity, the sweep's state, and one entry per trial:
                              {number, params, run_id, run_name, state, limit, planned_cost,
                               cost, value, released}
    SWEEP_DIR/study.sqlite    the Optuna study (workbench.sweep.study)
    SWEEP_DIR/controller.log  the detached controller's output

Trials are ordinary runs (own run directory and registry row); each carries the tag
``{"sweep": ID, "trial": N}`` in its status.json, and its name starts with the sweep's. The record
is rewritten atomically under a lock (the controller writes it; a cancel request adds to it), so a
reader never sees half of it and no update is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from workbench.errors import SweepNotFoundError
from workbench.runs.home import home
from workbench.runs.rundir import write_json_atomic

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"
BUDGET_STOPPED = "budget_stopped"  # ended because what is left could not pay for the next trial
ENDED = frozenset({SUCCEEDED, FAILED, CANCELLED, BUDGET_STOPPED})
# Trial states before a run exists, besides the run states of workbench.runs.rundir:
WAITING = "waiting"  # asked from the study, not started yet (a slot or the budget is awaited)
LAUNCHING = "launching"  # launch() called; the run id is written once it returns
SKIPPED = "skipped"  # never started: the budget left could not pay for it
# How long controller_alive() waits for a dead controller's lock to be released (see there).
DYING_WAIT_S = 30.0


def sweeps_dir() -> Path:
    path = home() / "sweeps"
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_sweep_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class SweepRecord:
    """Paths and locked, atomic reads and writes of one sweep directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    file = property(lambda self: self.path / "sweep.json")
    study_url = property(lambda self: f"sqlite:///{self.path / 'study.sqlite'}")
    log_file = property(lambda self: self.path / "controller.log")

    @property
    def id(self) -> str:
        return self.path.name

    def create(self, data: dict[str, Any]) -> SweepRecord:
        self.path.mkdir(parents=True, exist_ok=False)
        write_json_atomic(self.file, {**data, "id": self.id, "created": time.time(),
                                      "state": RUNNING, "trials": []})
        return self

    def read(self) -> dict[str, Any]:
        return json.loads(self.file.read_text(encoding="utf-8"))

    def update(self, change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
        """Apply ``change`` (editing the dict in place) under the record's lock."""
        with (self.path / ".sweep.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.read()
            change(data)
            data["updated"] = time.time()
            write_json_atomic(self.file, data)
        return data

    def write(self, **changes: Any) -> dict[str, Any]:
        return self.update(lambda d: d.update(changes))

    def update_trial(self, number: int, **changes: Any) -> dict[str, Any]:
        def change(data: dict[str, Any]) -> None:
            for t in data["trials"]:
                if t["number"] == number:
                    t.update(changes)
                    return
            data["trials"].append({"number": number, **changes})

        return self.update(change)

    @contextlib.contextmanager
    def controller_lock(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Held by the one live controller for its whole life; yields False if another holds it
        (after trying for ``wait_s``: a reader may be probing it for a moment, see
        :meth:`controller_alive`).

        The kernel releases an flock when its holder dies (even by kill -9), so a resume can
        always tell a live controller from a dead one without trusting a stored PID.
        """
        with (self.path / ".controller.lock").open("a") as lock:
            deadline = time.time() + wait_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.time() >= deadline:
                        yield False
                        return
                    time.sleep(0.2)
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def controller_alive(record: SweepRecord, dying_wait_s: float = DYING_WAIT_S) -> bool:
    """Is a controller running this sweep? It holds the lock for its life; one just started
    (recorded, not yet holding the lock) is known by its recorded identity.

    A process killed with kill -9 shows as gone (a zombie) once its main thread has exited, but
    its files, and so the lock, are closed only when its last thread has: the controller has
    several (torch's among them), and on a busy machine that can take a while. So a lock held
    while the recorded controller is gone is waited on for up to ``dying_wait_s``; a lock still
    held after that has a live holder.
    """
    from workbench.runs.procs import ProcessIdentity

    deadline = time.time() + dying_wait_s
    while True:
        ident = record.read().get("controller")
        who = ProcessIdentity.from_dict(ident) if ident else None
        recorded_alive = who is not None and who.here and who.alive()
        with record.controller_lock() as free:
            if free:
                return recorded_alive
        if recorded_alive or time.time() >= deadline:
            return True
        time.sleep(0.1)


def find_sweep(id_or_name: str) -> SweepRecord:
    """By exact id, else the newest sweep whose name is ``id_or_name``, else a unique id prefix."""
    root = sweeps_dir()
    exact = root / id_or_name
    if "/" not in id_or_name and (exact / "sweep.json").is_file():
        return SweepRecord(exact)
    found = [SweepRecord(p) for p in root.iterdir() if (p / "sweep.json").is_file()]
    named = [r for r in found if r.read().get("name") == id_or_name]
    if named:
        return max(named, key=lambda r: r.read().get("created", 0.0))
    prefixed = [r for r in found if r.id.startswith(id_or_name)]
    if len(prefixed) == 1:
        return prefixed[0]
    raise SweepNotFoundError(
        f"no sweep with id or name {id_or_name!r} under {root}; workbench.sweeps() lists them")


def list_sweeps() -> list[SweepRecord]:
    """Every sweep under WORKBENCH_HOME/sweeps, newest first."""
    found = [SweepRecord(p) for p in sweeps_dir().iterdir() if (p / "sweep.json").is_file()]
    return sorted(found, key=lambda r: r.read().get("created", 0.0), reverse=True)
