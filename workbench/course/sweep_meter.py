"""The service's meter of a student's sweep: each trial billed for the seconds the service saw it
hold its resources, from processes it followed itself, never from the sweep's files.

A course sweep's controller runs as the student (the worker's ``sweep`` request), and every trial
it starts is a run supervisor it spawns in a session of its own (``start_new_session``; course
sweeps start runs without a standby, so the supervisor starts once the run was accepted). The
meter follows the controller by identity (pid and start time) and, each tick
(:meth:`SweepMeter.tick`), walks its descendants:

- a direct child of the controller that leads its own session is a **trial**: billed at the
  sweep's rate (every card and core one run holds) from that process's start time (the kernel's,
  not a file's) until the first tick that sees it and its descendants gone; its run is named from
  its command line (a label, never money);
- any other descendant belongs to the controller (planning, data preparation: the student's own
  work, unbilled), or to the trial it descends from;
- a trial whose supervisor is gone has its remaining processes killed (a run does not outlive the
  process that holds it);
- when the ended trials' bills plus the running ones' (``KILL_MARGIN_S`` ahead) would reach the
  hold, every process of the sweep is stopped (TERM, then KILL ``GRACE_S`` later).

What a trial is charged is :meth:`SweepMeter.trial_bill` of it, whole minor units rounded up; the
ledger caps the sweep's charges at its hold. The records live in the service's state folder
(``sweep-meters/HOLD.json``), so a restarted service goes on where it was; a trial that ended
while the service was down is billed until the service came back, as a launch is
(:mod:`workbench.course.meter`).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from workbench.course.meter import GRACE_S, KILL_MARGIN_S, follow, send
from workbench.course.records import Records

if TYPE_CHECKING:
    from workbench.course.config import Course

Ident = tuple[int, float]  # pid, start time: a process, never confused with a later one


@dataclass
class Trial:
    start: float  # the supervisor's start time
    procs: list[Ident] = field(default_factory=list)  # supervisor first
    run: str = ""  # the run it names on its command line (a label)
    end: float | None = None
    charged: bool = False


@dataclass
class SweepAttempt:
    hold_id: int
    student: str
    uid: int
    sweep: str
    rate: float  # currency units an hour, one trial's cards and cores
    hold: int  # minor units, the whole sweep's
    concurrent: int  # trials at once, as the service admitted them (the caps count this)
    gpus: bool = False  # whether its trials see the machine's cards
    admitted: dict[str, Any] = field(default_factory=dict)  # the spec and space, as admitted
    roots: list[Ident] = field(default_factory=list)  # the controllers the worker started
    controllers: list[Ident] = field(default_factory=list)  # those and their own descendants
    trials: dict[str, Trial] = field(default_factory=dict)  # "pid@start" -> trial
    resumes: int = 0  # controllers the service started again
    stopping: float | None = None
    why: str = ""
    ended: float | None = None  # released: the sweep's money is final


class SweepMeter:
    def __init__(self, course: Course) -> None:
        self.course = course
        self.records = Records(course.state / "sweep-meters")

    def save(self, a: SweepAttempt) -> None:
        self.records.write(a.hold_id, asdict(a))

    def get(self, hold_id: int) -> SweepAttempt | None:
        data = self.records.read(hold_id)
        if data is None:
            return None
        for key in ("roots", "controllers"):
            data[key] = [tuple(p) for p in data[key]]
        data["trials"] = {k: Trial(**{**t, "procs": [tuple(p) for p in t["procs"]]})
                          for k, t in data["trials"].items()}
        return SweepAttempt(**data)

    def add_controller(self, a: SweepAttempt, controller: Ident) -> None:
        """Follow ``controller`` (the student's: checked) from now on."""
        pid, started = int(controller[0]), float(controller[1])
        try:
            p = psutil.Process(pid)
            ok = p.uids().real == a.uid and abs(p.create_time() - started) <= 0.05
        except psutil.NoSuchProcess:  # it ended already: nothing of it to follow
            ok = False
        if ok:
            a.roots.append((pid, started))
            a.controllers.append((pid, started))
        self.save(a)

    # -- money -----------------------------------------------------------------------------------
    def trial_bill(self, a: SweepAttempt, t: Trial, until: float | None = None) -> int:
        end = until or t.end or time.time()
        return self.course.minor(a.rate * max(0.0, end - t.start) / 3600)

    # -- watching --------------------------------------------------------------------------------
    def tick(self, a: SweepAttempt, now: float | None = None,
             runs: set[str] | None = None) -> tuple[bool, bool]:
        """Look at the sweep's processes once: whether any trial, and whether any of its
        controllers' processes, still runs. ``runs``: the sweep's trial runs by name; a
        supervisor of one of them that the walk missed (its controller died before the meter saw
        it start) is adopted, billed from its own start time."""
        now = now or time.time()
        if runs:
            adopt_orphans(a, runs)
        trials = False
        for t in a.trials.values():
            if t.end is not None:
                continue
            alive = follow(t.procs)
            if alive and t.procs[0] not in alive:  # its supervisor is gone: so is the run
                send(alive, signal.SIGKILL)
            if alive:
                trials = True
            else:
                t.end = now
        controllers = bool(follow_controllers(a))
        trials = trials or any(t.end is None for t in a.trials.values())  # new ones
        self._stop_at_hold(a, now)
        self.save(a)
        return trials, controllers

    def _stop_at_hold(self, a: SweepAttempt, now: float) -> None:
        running = [t for t in a.trials.values() if t.end is None]
        if a.rate <= 0 or not running:
            return
        ahead = sum(self.trial_bill(a, t, now + KILL_MARGIN_S) for t in running)
        ended = sum(self.trial_bill(a, t) for t in a.trials.values() if t.end is not None)
        if a.stopping is None and ended + ahead >= a.hold:
            a.stopping, a.why = now, "stopped by the course at its hold"
            self.stop(a, signal.SIGTERM)
        elif a.stopping is not None and now - a.stopping >= GRACE_S:
            self.stop(a, signal.SIGKILL)

    def stop(self, a: SweepAttempt, sig: int = signal.SIGTERM) -> None:
        """Signal every process of the sweep still running (its controllers and trials)."""
        procs = list(a.controllers) + [p for t in a.trials.values() if t.end is None
                                       for p in t.procs]
        send(procs, sig)


def follow_controllers(a: SweepAttempt) -> list[Ident]:
    """The controllers' processes still running; their new descendants sorted into the
    controllers' own (any process) and new trials (a direct child of a controller the worker
    started that leads a session of its own: a run's supervisor)."""
    known = set(a.controllers) | {p for t in a.trials.values() for p in t.procs}
    alive: list[Ident] = []
    found: list[tuple[psutil.Process, Ident]] = []
    for pid, started in list(a.controllers):
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
                continue
            kids = p.children(recursive=True)
        except psutil.Error:
            continue
        alive.append((pid, started))
        for k in kids:
            try:
                found.append((k, (k.pid, k.create_time())))
            except psutil.Error:
                continue
    root_pids = {pid for pid, started in a.roots if (pid, started) in alive}
    for k, ident in sorted(found, key=lambda f: f[1][1]):  # parents before their children
        if ident in known:
            continue
        known.add(ident)
        try:
            parent, leader = k.ppid(), os.getsid(k.pid) == k.pid
            argv = k.cmdline()
        except (psutil.Error, OSError):
            continue
        owner = _trial_of(a, parent)
        if owner is not None:
            owner.procs.append(ident)
        elif parent in root_pids and leader:
            _add_trial(a, ident, argv)
        else:
            a.controllers.append(ident)
        alive.append(ident)
    return alive


def adopt_orphans(a: SweepAttempt, runs: set[str]) -> None:
    """Add as trials the student's run supervisors (session leaders running
    ``workbench.runs.supervise`` on a run of ``runs``) the meter does not follow yet. ``runs``
    holds run ids, and the names the sweep gives a trial's run before launching it: a run's
    directory is its name, a launch time and 4 hex digits (workbench.runs.launching), so a
    supervisor started before the record got its run id is still found."""
    known = {p for t in a.trials.values() for p in t.procs}
    for p in psutil.process_iter(["uids", "cmdline", "create_time"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != a.uid:
                continue
            argv = p.info["cmdline"] or []
            ident = (p.pid, float(p.info["create_time"]))
            if (ident in known or not _names_one_of(_run_label(argv), runs)
                    or os.getsid(p.pid) != p.pid):
                continue
        except (psutil.Error, OSError):
            continue
        _add_trial(a, ident, argv)


_LAUNCHED = re.compile(r"(.+)-\d{8}-\d{6}-[0-9a-f]{4}")  # NAME-YYYYmmdd-HHMMSS-hhhh


def _names_one_of(label: str, runs: set[str]) -> bool:
    """Whether the run directory ``label`` is one of ``runs``, by id or by its launch name."""
    if not label:
        return False
    named = _LAUNCHED.fullmatch(label)
    return label in runs or (named is not None and named.group(1) in runs)


def _add_trial(a: SweepAttempt, supervisor: Ident, argv: list[str]) -> None:
    """A new trial, held by ``supervisor`` from its start time; keyed by its identity."""
    a.trials[f"{supervisor[0]}@{supervisor[1]:.3f}"] = Trial(supervisor[1], [supervisor],
                                                             _run_label(argv))


def _trial_of(a: SweepAttempt, parent: int) -> Trial | None:
    for t in a.trials.values():
        if t.end is None and any(pid == parent for pid, _ in t.procs):
            return t
    return None


def _run_label(argv: list[str]) -> str:
    """The run a supervisor's command line names (``-m workbench.runs.supervise RUN_DIR``)."""
    if "workbench.runs.supervise" in argv and argv[-1] != "workbench.runs.supervise":
        return Path(argv[-1]).name
    return ""


def attempt_view(meter: SweepMeter, a: SweepAttempt | None) -> dict[str, Any]:
    """Each trial's run label -> what it was billed (ended) or runs up to now (minor units)."""
    if a is None:
        return {}
    out: dict[str, Any] = {}
    for key, t in a.trials.items():
        label = t.run or key
        out[label] = out.get(label, 0) + meter.trial_bill(a, t)
    return out
