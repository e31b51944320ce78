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
# A sweep without a budget holds its trials' quotes (a plan each): at most this many.
SWEEP_QUOTES = 12


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

        self._check_concurrent(student)
        q = self.quote(student, spec)
        hold_id = self._hold(student, q["hold"], f"launch {q['spec'].name}")
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

    def _check_concurrent(self, student: str, more: int = 1) -> None:
        """Refuse ``more`` runs when the student's runs going, an open sweep counting as its
        ``concurrent`` trials, would pass the course's cap."""
        from workbench.sweep.record import SweepRecord

        going = 0
        for h in self.ledger.holds(student, open_only=True):
            if h.kind in (None, "launch", "resume"):
                going += 1
            elif h.kind == "sweep" and h.run_dir:
                going += int(SweepRecord(h.run_dir).read().get("concurrent") or 1)
        cap = self.course.caps.concurrent_runs
        if going + more > cap:
            raise CourseError(f"{student} already has {going} run(s) going and asks for {more} "
                              f"more; this course allows {cap} at once: wait for one to end or "
                              "stop it")

    def _hold(self, student: str, amount: int, note: str) -> int:
        try:
            return self.ledger.hold(student, amount, actor=student, note=note)
        except InsufficientCreditError as exc:
            raise InsufficientCreditError(student, exc.needed, exc.balance,
                                         self.course.money) from None

    def resume(self, user: str, run_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Hold what the resumed run may cost, then resume it with its budget limit at what it
        had spent plus the hold; settled (the cost it adds) like a launch."""
        from workbench.jobs import get_job

        student = self._student(user)
        with self._lock(student):
            last = self._visible(student, run_id)
            if last.charge is None:
                raise CourseError(f"run {run_id} is still going or not settled yet; wait for "
                                  "job.wait() to return before resuming it")
            bad = set(changes) - {"train.max_steps", "train.epochs"}
            if bad:
                raise CourseError(f"a course resume may change train.max_steps or train.epochs, "
                                  f"not {sorted(bad)} (the course sets the budget)")
            self._check_concurrent(student)
            job = get_job(run_id)
            spent = float(job.status().get("cost") or 0.0)
            # The whole run's plan: a resume from a snapshot adds at most that much.
            q = self.quote(student, job.spec.updated(**changes) if changes else job.spec)
            hold_id = self._hold(student, q["hold"], f"resume {run_id}")
            limit = spent + q["hold"] / self.course.minor_per_unit
            try:
                job.resume(**changes, **{"budget.limit": limit})
            except BaseException:
                self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="resume refused")
                raise
            self.ledger.attach_run(hold_id, run_id, str(job.run_dir.path), kind="resume",
                                   base_cost=spent)
        return {"run": run_id, "student": student, "hold": q["hold"],
                "hold_text": q["hold_text"], "planned_cost": q["planned_cost"],
                "currency": self.course.currency}

    def evaluate(self, user: str, run_id: str, tasks: list[str] | None,
                 knobs: dict[str, Any]) -> dict[str, Any]:
        """Score an ended run in a process of its own, held for ``eval_minutes`` at the rate of
        where it runs (:func:`~workbench.course.policy.eval_price`: the run's GPUs on its target,
        else one CPU core) and killed at that limit; charged for the seconds it ran."""
        import subprocess
        import sys

        from workbench.course.policy import eval_price
        from workbench.jobs import get_job

        student = self._student(user)
        h = self._visible(student, run_id)
        price, where = eval_price(self.course, get_job(run_id).spec)
        rate = f"{self.course.money(self.course.minor(price))} an hour ({where})"
        limit_s = round(self.course.caps.eval_minutes * 60)
        amount = self.course.minor(price * limit_s / 3600)
        hold_id = self._hold(student, amount, f"evaluate {run_id} at {rate}")
        self.ledger.attach_run(hold_id, run_id, h.run_dir or "", kind="evaluate")
        cmd = ["timeout", "-s", "KILL", str(limit_s), sys.executable, "-m", "workbench.cli",
               "eval", run_id]
        if tasks:
            cmd += ["--tasks", ",".join(tasks)]
        for key in ("max_samples", "max_new_tokens"):
            if knobs.get(key) is not None:
                cmd += [f"--{key.replace('_', '-')}", str(int(knobs[key]))]
        started = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            used = min(amount, self.course.minor(price * (time.time() - started) / 3600))
            self.ledger.settle(hold_id, used, actor=SERVICE_ACTOR, note=f"evaluate {run_id}")
        if proc.returncode != 0:
            why = "it ran past the course's eval_minutes" if proc.returncode in (-9, 137) else (
                proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise CourseError(f"evaluating {run_id} failed ({why}); charged "
                              f"{self.course.money(used)} at {rate}")
        return {"run": run_id, "table": proc.stdout.strip(), "charge": used,
                "charge_text": self.course.money(used), "hold": amount, "rate": price,
                "rate_text": rate}

    # -- settling --------------------------------------------------------------------------------
    def settle_ended(self) -> list[str]:
        """Charge and release every open hold whose run has ended and released; the run ids."""
        from workbench.jobs import get_job
        from workbench.rundir import TERMINAL

        settled = []
        for h in self.ledger.holds(open_only=True):
            if h.kind == "evaluate" and time.time() - h.at > self.course.caps.eval_minutes * 60 \
                    + UNRELEASED_SETTLE_S:
                # The service died while it ran; `timeout -s KILL` ended it by its limit, which
                # is all it could have used: the whole hold is charged.
                amount = h.amount
                if self.ledger.settle(h.hold_id, amount, actor=SERVICE_ACTOR,
                                      note=f"evaluate {h.run_id} (service restarted)"):
                    settled.append(str(h.run_id))
                continue
            if h.run_id is None or h.kind not in ("launch", "resume"):
                continue  # launched moments ago, or an endpoint (workbench.course.endpoints)
            try:
                status = get_job(h.run_id).status()
            except WorkbenchError:
                continue
            # Only an end after this hold counts: a resumed run's status.json still carries the
            # previous attempt's ``released`` while the new attempt is queued.
            ended = status.get("state") in TERMINAL
            released = ended and float(status.get("released") or 0) >= h.at
            ended_at = float(status.get("ended") or 0)
            stale = ended and ended_at >= h.at and time.time() - ended_at > UNRELEASED_SETTLE_S
            if not (released or stale):
                continue
            # A resume pays only what it added to the run's bill.
            charge = self.course.minor(max(0.0, float(status.get("cost") or 0.0) - h.base_cost))
            note = f"run {h.run_id} {status.get('state')}" + ("" if released else " (unreleased)")
            if self.ledger.settle(h.hold_id, charge, actor=SERVICE_ACTOR, note=note):
                settled.append(h.run_id)
        return settled

    # -- views -----------------------------------------------------------------------------------
    def _run_view(self, h: RunHold) -> dict[str, Any]:
        from workbench.jobs import get_job

        view: dict[str, Any] = {"run": h.run_id, "student": h.student, "hold": h.amount,
                                "charge": h.charge, "held_at": h.at, "kind": h.kind or "launch"}
        if h.run_id and h.kind in (None, "launch", "resume"):
            try:
                status = get_job(h.run_id).status()
            except WorkbenchError:
                status = {}
            view.update({k: status.get(k) for k in ("state", "step", "total_steps", "last_loss",
                                                    "cost", "error", "note", "stop_reason")})
            view["released"] = "released" in status
        elif h.kind == "sweep" and h.charge is not None:
            # A sweep's own charge is nothing more: what it cost is its trials' charges.
            view["charge"] = sum(self.ledger.charged_trials(h.hold_id).values())
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

    def students_table(self, user: str) -> list[dict[str, Any]]:
        """Instructors: each student's account (minor units) and how many runs they launched."""
        if not self.is_instructor(user):
            raise Forbidden(f"{user} is not an instructor of {self.course.name}")
        out = []
        for student in self.ledger.students():
            holds = self.ledger.holds(student)
            out.append({**self.ledger.account(student).to_dict(),
                        "runs": len([h for h in holds if h.run_id and h.kind == "launch"]),
                        "running": len([h for h in holds if h.charge is None])})
        return out

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
            n = len([h for h in self.ledger.holds(student) if h.run_id and h.kind == "launch"])
            w.writerow([student, *(f"{v / per:.2f}" for v in (a.credits, a.grants, a.charges,
                                                              a.held, a.balance)),
                        n, self.course.currency])
        return out.getvalue()
