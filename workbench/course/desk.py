"""The course desk: price a student's run, hold it against their credit, launch it, settle it.

The order is what keeps a student inside their credit: the spec is priced by the course
(:mod:`~workbench.course.policy`) and planned; the planned cost (times ``hold_margin``) is held in
the ledger, refused there if the credit is short, *before* anything is written; the run is then
launched with ``budget.limit`` equal to the hold, so its own budget stop (:mod:`workbench.budget`)
ends it before it could cost more. :meth:`CourseDesk.settle_ended` charges each ended run what
its status.json billed, once its supervisor has ``released`` the resources, and releases the hold.
Runs are owned by the service's WORKBENCH_HOME; the ledger's ``runs`` table tags each with its
student. Nothing here speaks HTTP (:mod:`workbench.course.service` does).
"""

from __future__ import annotations

import csv
import io
import threading
import time
from typing import Any

from workbench.course.config import Course
from workbench.course.ledger import Ledger, RunHold
from workbench.errors import (
    CourseError,
    InsufficientCreditError,
    WorkbenchError,
)

SERVICE_ACTOR = "course-service"
# A run that ended without its supervisor marking ``released`` (the supervisor was killed) is
# settled with what status.json last billed once it has been over this long.
UNRELEASED_SETTLE_S = 120.0


class Forbidden(CourseError):
    """The user may not do this (a student acting as an instructor or on another's run)."""


class CourseDesk:
    def __init__(self, course: Course, ledger: Ledger | None = None) -> None:
        self.course = course
        self.ledger = ledger or Ledger(course.database_url)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def open_accounts(self) -> None:
        for student in self.course.students:
            self.ledger.open_account(student, self.course.minor(self.course.starting_credit(student)),
                                     actor=SERVICE_ACTOR)

    def is_instructor(self, user: str) -> bool:
        return user in self.course.instructors

    def _student(self, user: str) -> str:
        if user not in self.course.students:
            raise Forbidden(f"{user} is not a student of {self.course.name}; only students launch "
                            "runs on the course's credit")
        return user

    # -- launching -------------------------------------------------------------------------------
    def quote(self, user: str, spec: Any) -> dict[str, Any]:
        """What a launch would hold, without holding it."""
        from workbench.course.policy import check_plan, priced_spec
        from workbench.plan import plan
        from workbench.spec import RunSpec

        priced = priced_spec(self.course, RunSpec.coerce(spec))
        result = plan(priced)
        cost = check_plan(self.course, result)
        hold = self.course.minor(cost * self.course.hold_margin)
        return {"spec": priced, "plan": result, "hold": hold, "planned_cost": cost,
                "hold_text": self.course.money(hold)}

    def launch(self, user: str, spec: Any) -> dict[str, Any]:
        """Hold, then launch; a refused hold starts nothing and writes no run directory."""
        student = self._student(user)
        with self._lock(student):  # the concurrent-runs cap holds for two launches at once
            return self._launch(student, spec)

    def _lock(self, student: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(student, threading.Lock())

    def _launch(self, student: str, spec: Any) -> dict[str, Any]:
        from workbench.launching import launch
        from workbench.registry import Registry

        open_runs = self.ledger.holds(student, open_only=True)
        if len(open_runs) >= self.course.caps.concurrent_runs:
            raise CourseError(f"{student} already has {len(open_runs)} run(s) going; this course "
                              f"allows {self.course.caps.concurrent_runs} at once: wait for one "
                              "to end or stop it")
        q = self.quote(student, spec)
        try:
            hold_id = self.ledger.hold(student, q["hold"], actor=student,
                                       note=f"launch {q['spec'].name}")
        except InsufficientCreditError as exc:
            raise InsufficientCreditError(student, exc.needed, exc.balance,
                                         self.course.money) from None
        limited = q["spec"].updated(**{"budget.limit": q["hold"] / self.course.minor_per_unit})
        try:
            # An explicit registry: the service's own, never the course hook in launch().
            job = launch(limited, registry=Registry())
        except BaseException:
            # Nothing ran: the whole hold comes back.
            self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="launch refused")
            raise
        self.ledger.attach_run(hold_id, job.id, str(job.run_dir.path))
        return {"run": job.id, "student": student, "hold": q["hold"], "hold_text": q["hold_text"],
                "planned_cost": q["planned_cost"], "currency": self.course.currency}

    # -- settling --------------------------------------------------------------------------------
    def settle_ended(self) -> list[str]:
        """Charge and release every open hold whose run has ended and released; the run ids."""
        from workbench.jobs import get_job
        from workbench.rundir import TERMINAL

        settled = []
        for h in self.ledger.holds(open_only=True):
            if h.run_id is None:
                continue  # launched moments ago, or its launch is still being written
            try:
                status = get_job(h.run_id).status()
            except WorkbenchError:
                continue
            ended = status.get("state") in TERMINAL
            released = "released" in status
            stale = ended and time.time() - float(status.get("ended") or time.time()) \
                > UNRELEASED_SETTLE_S
            if not (released or stale):
                continue
            charge = self.course.minor(status.get("cost") or 0.0)
            note = f"run {h.run_id} {status.get('state')}" + ("" if released else " (unreleased)")
            if self.ledger.settle(h.hold_id, charge, actor=SERVICE_ACTOR, note=note):
                settled.append(h.run_id)
        return settled

    # -- views -----------------------------------------------------------------------------------
    def _run_view(self, h: RunHold) -> dict[str, Any]:
        from workbench.jobs import get_job

        view: dict[str, Any] = {"run": h.run_id, "student": h.student, "hold": h.amount,
                                "charge": h.charge, "held_at": h.at}
        if h.run_id:
            try:
                status = get_job(h.run_id).status()
            except WorkbenchError:
                status = {}
            view.update({k: status.get(k) for k in ("state", "step", "total_steps", "last_loss",
                                                    "cost", "error", "note", "stop_reason")})
            view["released"] = "released" in status
        return view

    def me(self, user: str) -> dict[str, Any]:
        out: dict[str, Any] = {"user": user, "instructor": self.is_instructor(user),
                               "currency": self.course.currency,
                               "minor_per_unit": self.course.minor_per_unit}
        if user in self.course.students:
            account = self.ledger.account(user)
            out.update(account.to_dict(), balance_text=self.course.money(account.balance))
            out["runs"] = [self._run_view(h) for h in self.ledger.holds(user)]
        return out

    def runs(self, user: str) -> list[dict[str, Any]]:
        who = None if self.is_instructor(user) else self._student(user)
        return [self._run_view(h) for h in self.ledger.holds(who)]

    def run(self, user: str, run_id: str) -> dict[str, Any]:
        h = self._visible(user, run_id)
        return self._run_view(h)

    def _visible(self, user: str, run_id: str) -> RunHold:
        h = self.ledger.run_hold(run_id)
        if h.student != user and not self.is_instructor(user):
            raise Forbidden(f"run {run_id} is not {user}'s; GET /runs lists yours")
        return h

    def stop(self, user: str, run_id: str) -> str:
        from workbench.jobs import get_job

        self._visible(user, run_id)
        return get_job(run_id).cancel()

    def grant(self, user: str, student: str, amount: float, note: str = "") -> dict[str, Any]:
        if not self.is_instructor(user):
            raise Forbidden(f"{user} is not an instructor of {self.course.name}; only instructors "
                            "grant credit")
        if student not in self.course.students:
            raise CourseError(f"{student!r} is not a student of {self.course.name}")
        self.ledger.grant(student, self.course.minor(amount), actor=user, note=note)
        return self.ledger.account(student).to_dict()

    def export_csv(self, user: str) -> str:
        if not self.is_instructor(user):
            raise Forbidden(f"{user} is not an instructor of {self.course.name}")
        out = io.StringIO()
        w = csv.writer(out)
        w.writerow(["student", "credits", "grants", "charges", "held", "balance", "runs",
                    "currency"])
        per = self.course.minor_per_unit
        for student in self.ledger.students():
            a = self.ledger.account(student)
            n = len([h for h in self.ledger.holds(student) if h.run_id])
            w.writerow([student, *(f"{v / per:.2f}" for v in (a.credits, a.grants, a.charges,
                                                              a.held, a.balance)),
                        n, self.course.currency])
        return out.getvalue()
