"""The course desk: admit a student's run, hold it against their credit, start it as the
student, settle it from the service's own meter.

The order is what keeps a student inside their credit: the spec is admitted and priced by the
course (:mod:`~workbench.course.policy`) and planned as the student; the planned cost (times
``hold_margin``) is held in the ledger, refused there if the credit is short, *before* anything
is written; the run is then launched as the student (:mod:`~workbench.course.students`, in the
student's own space) with ``budget.limit`` equal to the hold, and the service meters the attempt
itself (:mod:`~workbench.course.meter`): from the moment the launch handed it its resources to
the moment its last process is gone, stopped before it could pass the hold.
:meth:`CourseDesk.settle_ended` charges each ended attempt its metered bill and releases the
hold. Nothing here speaks HTTP (:mod:`workbench.course.service` does).
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from typing import Any

from workbench.course.config import Course
from workbench.course.meter import Meter
from workbench.course.students import Worker, parse_answer, read_json, space
from workbench.errors import (
    CourseError,
    InsufficientCreditError,
)
from workbench.runs.ledger import Ledger, RunHold

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
        self.meter = Meter(course)
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
        """What a launch would hold, without holding it: the spec admitted and priced by the
        course, planned as the student."""
        from types import SimpleNamespace

        from workbench.course.policy import admit, cards, check_plan

        student = self._student(user)
        priced = admit(self.course, str(space(self.course, student)), spec)
        figures = Worker(self.course, student, {"verb": "quote", "spec": _data(priced)},
                         gpus=cards(priced) > 0).answer()
        result = SimpleNamespace(cost=figures.get("cost"), hours=figures.get("hours"))
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
        from workbench.course.policy import cards

        self._check_concurrent(student)
        q = self.quote(student, spec)
        hold_id = self._hold(student, q["hold"], f"launch {q['spec'].name}")
        limited = q["spec"].updated(**{"budget.limit": q["hold"] / self.course.minor_per_unit})
        try:
            answer = Worker(self.course, student, {"verb": "launch", "spec": _data(limited)},
                            gpus=cards(limited) > 0).answer()
        except BaseException:
            # Nothing ran: the whole hold comes back.
            self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="launch refused")
            raise
        self.ledger.attach_run(hold_id, answer["run"], answer["run_dir"])
        self._meter(hold_id, student, answer, limited, q["hold"])
        return {"run": answer["run"], "student": student, "hold": q["hold"],
                "hold_text": q["hold_text"], "planned_cost": q["planned_cost"],
                "currency": self.course.currency}

    def _meter(self, hold_id: int, student: str, answer: dict[str, Any], spec: Any,
               hold: int) -> None:
        import pwd

        from workbench.course.policy import hourly_rate

        self.meter.begin(hold_id, student, pwd.getpwnam(student).pw_uid, answer["run"],
                         answer.get("pid"), hourly_rate(spec), hold)

    def _check_concurrent(self, student: str, more: int = 1) -> None:
        """Refuse ``more`` runs when the student's runs going, an open sweep counting as its
        ``concurrent`` trials, would pass the course's cap."""
        from workbench.course.sweep_meter import SweepMeter

        going = 0
        for h in self.ledger.holds(student, open_only=True):
            if h.kind in (None, "launch", "resume"):
                going += 1
            elif h.kind == "sweep":  # as many as it was admitted with (the service's record)
                a = SweepMeter(self.course).get(h.hold_id)
                going += a.concurrent if a is not None else 1
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
        """Hold what the resumed run may cost, then resume it as the student; the new attempt is
        metered and settled like a launch."""
        from workbench.course.policy import cards

        student = self._student(user)
        with self._lock(student):
            last = self._visible(student, run_id)
            bad = set(changes) - {"train.max_steps", "train.epochs"}
            if bad:
                raise CourseError(f"a course resume may change train.max_steps or train.epochs, "
                                  f"not {sorted(bad)} (the course sets the budget)")
            if last.charge is None:
                raise CourseError(f"run {run_id} is still going or not settled yet; wait for "
                                  "job.wait() to return before resuming it")
            self._check_concurrent(student)
            # The run's spec as the student's worker reads it, admitted again like a launch's.
            known = Worker(self.course, student, {"verb": "spec", "run": run_id}).answer()
            spec = json.loads(json.dumps(known["spec"]))  # a copy: known's is checked at resume
            for key, value in changes.items():
                section, name = key.split(".", 1)
                spec.setdefault(section, {})[name] = value
            spec.pop("budget", None)
            # The whole run's plan: a resume from a snapshot adds at most that much.
            q = self.quote(student, spec)
            hold_id = self._hold(student, q["hold"], f"resume {run_id}")
            limit = float(known.get("spent") or 0.0) + q["hold"] / self.course.minor_per_unit
            try:
                answer = Worker(self.course, student, {
                    "verb": "resume", "run": run_id, "spec": known["spec"],
                    "changes": {**changes, "budget.limit": limit}},
                    gpus=cards(q["spec"]) > 0).answer()
            except BaseException:
                self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="resume refused")
                raise
            self.ledger.attach_run(hold_id, run_id, answer["run_dir"], kind="resume")
            self._meter(hold_id, student, answer, q["spec"], q["hold"])
        return {"run": run_id, "student": student, "hold": q["hold"],
                "hold_text": q["hold_text"], "planned_cost": q["planned_cost"],
                "currency": self.course.currency}

    def evaluate(self, user: str, run_id: str, tasks: list[str] | None,
                 knobs: dict[str, Any]) -> dict[str, Any]:
        """Score an ended run as the student, held for ``eval_minutes`` at the rate of where it
        runs (:func:`~workbench.course.policy.eval_price`: the run's GPUs on its target, else
        one CPU core) and ended at that limit; charged for the seconds the service saw it run."""
        request = {"verb": "evaluate", "tasks": tasks or None,
                   **{k: knobs.get(k) for k in ("max_samples", "max_new_tokens")}}
        return self._timed(user, run_id, "evaluate", request)

    def export(self, user: str, run_id: str, formats: list[str],
               quant: list[str]) -> dict[str, Any]:
        """Export an ended run as the student, into the run's own folder in their space (merged,
        GGUF, Ollama: workbench.serve.export_run); held and charged like an evaluation."""
        return self._timed(user, run_id, "export",
                           {"verb": "export", "formats": formats, "quant": quant})

    def _timed(self, user: str, run_id: str, kind: str,
               request: dict[str, Any]) -> dict[str, Any]:
        """Work on an ended run (``kind``: evaluate or export) as the student: held for
        ``eval_minutes`` at the rate of the run's resources, ended at that limit, charged for
        the seconds the service saw it run."""
        from workbench.course.policy import admit, cards, eval_price

        student = self._student(user)
        h = self._visible(student, run_id)
        known = Worker(self.course, student, {"verb": "spec", "run": run_id}).answer()
        spec = {k: v for k, v in known["spec"].items() if k != "budget"}
        admitted = admit(self.course, str(space(self.course, student)), spec)
        price, where = eval_price(self.course, admitted)
        rate = f"{self.course.money(self.course.minor(price))} an hour ({where})"
        limit_s = round(self.course.caps.eval_minutes * 60)
        amount = self.course.minor(price * limit_s / 3600)
        hold_id = self._hold(student, amount, f"{kind} {run_id} at {rate}")
        self.ledger.attach_run(hold_id, run_id, h.run_dir or "", kind=kind)
        worker = Worker(self.course, student, {**request, "run": run_id, "limit_s": limit_s},
                        gpus=cards(admitted) > 0)
        rc, out, err, seconds = -1, "", "", float(limit_s)
        try:
            rc, out, err, seconds = worker.run(timeout=limit_s)
        finally:
            used = min(amount, self.course.minor(price * seconds / 3600))
            self.ledger.settle(hold_id, used, actor=SERVICE_ACTOR, note=f"{kind} {run_id}")
        if rc != 0:
            if rc == -9:
                why = "it ran past the course's eval_minutes"
            else:
                try:
                    parse_answer(rc, out, err, student)
                    why = f"exit {rc}"
                except CourseError as exc:
                    why = str(exc)
            raise CourseError(f"{'evaluating' if kind == 'evaluate' else 'exporting'} {run_id} "
                              f"failed ({why}); charged {self.course.money(used)} at {rate}")
        answer = parse_answer(rc, out, err, student)
        table = "\n".join(line for line in out.splitlines() if not line.startswith("{"))
        return {"run": run_id, "table": table.strip(), "charge": used,
                "charge_text": self.course.money(used), "hold": amount, "rate": price,
                "rate_text": rate, **{k: v for k, v in answer.items() if k != "run"}}

    # -- settling --------------------------------------------------------------------------------
    def settle_ended(self) -> list[str]:
        """Meter the attempts going, then charge and release every open hold whose attempt the
        meter saw end (:mod:`~workbench.course.meter`); the run ids."""
        self.meter.tick()
        settled = []
        for h in self.ledger.holds(open_only=True):
            if h.kind in ("evaluate", "export") and time.time() - h.at > \
                    self.course.caps.eval_minutes * 60 + UNRELEASED_SETTLE_S:
                # The service died while it ran; the worker ends itself at the limit, which is
                # all it could have used: the whole hold is charged.
                amount = h.amount
                if self.ledger.settle(h.hold_id, amount, actor=SERVICE_ACTOR,
                                      note=f"{h.kind} {h.run_id} (service restarted)"):
                    settled.append(str(h.run_id))
                continue
            if h.run_id is None or h.kind not in ("launch", "resume"):
                continue  # launched moments ago, or an endpoint (workbench.course.endpoints)
            a = self.meter.get(h.hold_id)
            if a is None or a.end is None:
                continue
            charge = self.meter.bill(a)
            note = (f"run {h.run_id}: {a.end - a.start:.0f} s metered at "
                    f"{a.rate:g} {self.course.currency}/h" + (f" ({a.why})" if a.why else ""))
            if self.ledger.settle(h.hold_id, charge, actor=SERVICE_ACTOR, note=note):
                settled.append(h.run_id)
        return settled

    # -- views -----------------------------------------------------------------------------------
    def _run_view(self, h: RunHold) -> dict[str, Any]:
        view: dict[str, Any] = {"run": h.run_id, "student": h.student, "hold": h.amount,
                                "charge": h.charge, "held_at": h.at, "kind": h.kind or "launch"}
        if h.run_id and h.kind in (None, "launch", "resume"):
            # Progress from the run's status.json, read only if it is the student's own file;
            # what it costs is the meter's figure, never the file's.
            status = read_json(f"{h.run_dir}/status.json", h.student) if h.run_dir else {}
            view.update({k: status.get(k) for k in ("state", "step", "total_steps", "last_loss",
                                                    "error", "note", "stop_reason")})
            a = self.meter.get(h.hold_id)
            view["cost"] = None if a is None else self.meter.bill(a) / self.course.minor_per_unit
            view["released"] = a is not None and a.end is not None
        elif h.kind == "sweep" and h.charge is not None:
            # A sweep's own charge is nothing more: what it cost is its trials' charges.
            view["charge"] = sum(self.ledger.charged_trials(h.hold_id).values())
        return view

    def me(self, user: str) -> dict[str, Any]:
        out: dict[str, Any] = {"user": user, "instructor": self.is_instructor(user),
                               "currency": self.course.currency,
                               "minor_per_unit": self.course.minor_per_unit}
        if user in self.course.students:
            out["space"] = str(space(self.course, user))  # where the student's files may live
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
        """Cancel the run as its student; the meter bills what ran until its processes ended."""
        h = self._visible(user, run_id)
        return str(Worker(self.course, h.student, {"verb": "cancel", "run": run_id})
                   .answer()["state"])

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


def _data(spec: Any) -> dict[str, Any]:
    return dict(spec.model_dump(mode="json"))
