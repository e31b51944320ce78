"""The service's meter of students' run attempts: what a run is billed, from what the service
itself observed, never from a file the student can write.

An attempt is metered from the moment the worker handed it its resources (the launch or resume
returned, the data prepared) until the service sees its last process gone: the process that
holds the attempt (its supervisor, checked to be the student's) and every descendant the meter
has seen it start. Each tick (:meth:`Meter.tick`, every couple of seconds from the service):

- the processes are looked at again (new descendants added by identity: pid and start time);
- an attempt whose holder is gone has its remaining processes ended: an attempt does not outlive
  the process that holds it;
- an attempt whose bill would reach its hold within ``KILL_MARGIN_S`` is stopped (TERM, then
  KILL ``GRACE_S`` later), so a charge never passes its hold;
- an attempt with no process left is ended at this tick: the first time the service saw it
  gone. After an outage of the service that is when it came back, so the bill covers every second
  the run may have held its resources (never less than it used, never more than its hold); the
  run's own files, which the student can write, are not evidence.

The records live in the service's state folder (``meters/HOLD.json``), so a restarted service
picks up where it was. The bill is ``rate x (end - start)`` in whole minor units, rounded up
and never more than the hold.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import psutil

from workbench.course.records import Records
from workbench.errors import CourseError

if TYPE_CHECKING:
    from workbench.course.config import Course

GRACE_S = 10.0  # TERM to KILL when the meter stops an attempt at its hold
KILL_MARGIN_S = 2 * GRACE_S  # stop this long before the bill would reach the hold


@dataclass
class Attempt:
    hold_id: int
    student: str
    uid: int
    run: str
    rate: float  # currency units an hour, every card and core the attempt holds
    hold: int  # minor units
    start: float
    procs: list[tuple[int, float]] = field(default_factory=list)  # holder first
    last_seen: float = 0.0  # the last tick that saw it alive: with ``end``, an outage billed
    stopping: float | None = None
    end: float | None = None
    why: str = ""


class Meter:
    def __init__(self, course: Course) -> None:
        self.course = course
        self.records = Records(course.state / "meters")

    def _save(self, a: Attempt) -> None:
        self.records.write(a.hold_id, asdict(a))

    def get(self, hold_id: int) -> Attempt | None:
        data = self.records.read(hold_id)
        if data is None:
            return None
        data["procs"] = [tuple(p) for p in data["procs"]]
        return Attempt(**data)

    def begin(self, hold_id: int, student: str, uid: int, run: str, pid: int | None,
              rate: float, hold: int, start: float | None = None) -> Attempt:
        """Meter the attempt held by process ``pid``, which must be the student's."""
        procs: list[tuple[int, float]] = []
        if pid is not None:
            try:
                p = psutil.Process(pid)
                owner, started = p.uids().real, p.create_time()
            except psutil.NoSuchProcess:  # it ended already: billed from now to the next tick
                owner, started = uid, 0.0
            if owner != uid:
                raise CourseError(f"run {run}'s process {pid} is not {student}'s; nothing is "
                                  "billed to a process the service cannot tie to the student")
            if started:
                procs.append((pid, started))
        now = time.time()
        a = Attempt(hold_id, student, uid, run, rate, hold, start or now, procs, now)
        self._save(a)
        return a

    def bill(self, a: Attempt, until: float | None = None) -> int:
        """The attempt's bill in minor units (until ``until``, its end, or now): never past its
        hold."""
        end = until or a.end or time.time()
        return min(a.hold, self.course.minor(a.rate * max(0.0, end - a.start) / 3600))

    def open(self) -> list[Attempt]:
        out = []
        for key in self.records.names():
            a = self.get(int(key))
            if a is not None and a.end is None:
                out.append(a)
        return out

    def tick(self, now: float | None = None) -> list[Attempt]:
        """Look at every open attempt; the attempts that ended at this tick."""
        ended = []
        for a in self.open():
            now_ = now or time.time()
            alive = self._alive(a)
            if alive:
                self._stop_at_hold(a, alive, now_)
                holder_gone = not a.procs or a.procs[0] not in alive
                if holder_gone:
                    send(alive, signal.SIGKILL)
                a.last_seen = now_
            else:
                a.end = now_
                ended.append(a)
            self._save(a)
        return ended

    def _alive(self, a: Attempt) -> list[tuple[int, float]]:
        return follow(a.procs)

    def _stop_at_hold(self, a: Attempt, alive: list[tuple[int, float]], now: float) -> None:
        if a.rate <= 0:
            return
        deadline = a.start + (a.hold / self.course.minor_per_unit) / a.rate * 3600 - KILL_MARGIN_S
        if a.stopping is None and now >= deadline:
            a.stopping, a.why = now, "stopped by the course at its hold"
            send(alive, signal.SIGTERM)
        elif a.stopping is not None and now - a.stopping >= GRACE_S:
            send(alive, signal.SIGKILL)


def send(procs: list[tuple[int, float]], sig: int) -> None:
    """Signal each of ``procs`` (pid, start time) that is still that process."""
    for pid, started in procs:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) <= 0.05:
                p.send_signal(sig)
        except psutil.Error:
            continue


def follow(procs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The processes of ``procs`` (pid, start time) still running; descendants of the running
    ones are added to ``procs`` as they are seen, so a process that outlives its parent is still
    followed."""
    alive: list[tuple[int, float]] = []
    for pid, started in list(procs):
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
                ident = (k.pid, k.create_time())
            except psutil.Error:
                continue
            if ident not in procs:
                procs.append(ident)
                alive.append(ident)
    return alive
