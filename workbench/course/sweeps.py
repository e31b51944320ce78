"""Course sweeps: a student's sweep held against their credit as a whole, trial by trial charged.

The service starts the ordinary sweep (:func:`workbench.sweep.start.sweep`, its detached
controller and runs, in the service's WORKBENCH_HOME); this module only owns the money around it:

1. the space is checked (a course sets ``budget.*`` and ``resources.*`` itself), every discrete
   trial is quoted like a launch (caps included), and the sweep's whole budget is held: the
   ``budget`` asked, or the quoted total of the trials. A hold the credit cannot take is refused
   (402) before anything is written;
2. the sweep runs with its ``budget`` equal to the hold, so its controller starts a trial only when
   the trial's price fits what is left of it and gives each trial a ``budget.limit`` within it;
3. :meth:`CourseSweeps.settle` (run by the service when it starts and every few seconds) charges
   each trial's final bill against the hold as the trial ends (:meth:`Ledger.charge_trial`), and
   releases the rest once the sweep has ended or was stopped;
4. a sweep not ended whose controller is gone (killed, the machine restarted) is resumed by that
   same pass, against the same hold (the sweep's own resume: charged trials are kept, its budget
   is still the hold); one that cannot go on (its spec or space no longer valid, or its controller
   died again after ``SERVICE_RESUMES`` resumes) is ended ``failed`` with the reason in its
   ``error``, its running trials cancelled and charged their runs' bills, and the rest released.
   A sweep whose folder is gone is ended the same way, its trials found by their runs' sweep tag
   and the reason in the ledger's release row.

Students see and stop only their own sweeps; instructors any.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from workbench.course.desk import (
    SERVICE_ACTOR,
    SWEEP_QUOTES,
    UNRELEASED_SETTLE_S,
    CourseDesk,
    Forbidden,
)
from workbench.errors import CourseError, WorkbenchError
from workbench.runs.ledger import RunHold
from workbench.sweep.handle import Sweep
from workbench.sweep.record import CANCELLED, ENDED, FAILED, SweepRecord, controller_alive

# sweep()'s keyword arguments a student may give (target goes in the spec).
OPTIONS = ("strategy", "trials", "objective", "direction", "budget", "concurrent", "seed",
           "pruner", "prune_after")
COURSE_SET = ("budget.", "resources.")  # space paths the course decides, not the sweep
SWEEPABLE = ("train.", "method.", "data.")
NOT_SWEEPABLE = ("method.rewards", "data.sources", "data.clean")
# Times the service resumes one sweep whose controller died before it ends it instead (a
# controller that dies at every start must not be restarted forever).
SERVICE_RESUMES = 3
log = logging.getLogger("workbench.course")


class CourseSweeps:
    def __init__(self, desk: CourseDesk) -> None:
        self.desk, self.course, self.ledger = desk, desk.course, desk.ledger

    # -- starting --------------------------------------------------------------------------------
    def start(self, user: str, spec: Any, space: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Hold the sweep's budget, then start the sweep with that budget; a refused hold starts
        nothing and writes no sweep directory."""
        from workbench.course.policy import admit

        student = self.desk._student(user)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise CourseError(f"a course sweep takes {', '.join(OPTIONS)}, not {unknown}")
        with self.desk._lock(student):
            # The trials run in the service's own home, with its rights: their spec may name
            # nothing of the student's space (model, data, eval files, lm-eval task files,
            # snapshot storage), only what the course file lists.
            base = admit(self.course, None, spec)
            concurrent = options.get("concurrent", 1)
            if isinstance(concurrent, int) and not isinstance(concurrent, bool):
                self.desk._check_concurrent(student, more=concurrent)
            amount = self._amount(student, base, space, options)
            hold_id = self.desk._hold(student, amount, f"sweep {base.name}")
            try:
                from workbench.sweep.start import sweep

                s = sweep(base, space=space, **{**options,
                                                "budget": amount / self.course.minor_per_unit})
            except BaseException:
                self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="sweep refused")
                raise
            self.ledger.attach_run(hold_id, s.id, str(s.record.path), kind="sweep")
        return {"sweep": s.id, "student": student, "hold": amount,
                "hold_text": self.course.money(amount), "currency": self.course.currency}

    def _amount(self, student: str, base: Any, space: Any, options: dict[str, Any]) -> int:
        """What the sweep holds, in minor units: ``budget`` if given, else the trials' quotes."""
        from workbench.sweep.space import grid_size, parse_space

        params = parse_space(space, base)  # a bad space: SweepError, which says what to fix
        for p in params:
            if p.path.startswith(COURSE_SET):
                raise CourseError(f"space[{p.path!r}]: the course sets {p.path} for every run; "
                                  "sweep training or method fields instead")
            if not p.path.startswith(SWEEPABLE) or p.path.startswith(NOT_SWEEPABLE):
                raise CourseError(f"space[{p.path!r}]: a course sweep varies train.*, method.* "
                                  "(not rewards) and data.* (not sources or cleaning) fields")
        budget = options.get("budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or budget <= 0):
            raise CourseError(f"budget must be a positive amount in {self.course.currency} "
                              f"(the whole sweep's), not {budget!r}")
        discrete = all(p.choices is not None or p.step is not None for p in params)
        size = grid_size(params) if discrete else None
        trials = options.get("trials") or size
        quotes: list[int] = []
        if size is not None and size <= SWEEP_QUOTES:
            changes: list[dict[str, Any]] = [{}]
            for p in params:
                changes = [{**c, p.path: v} for c in changes for v in p.grid_values()]
            # Each trial's caps are checked as its launch's would be (a CourseError says which).
            quotes = [self.desk.quote(student, base.updated(**c).model_dump(mode="json"))["hold"]
                      for c in changes]
        if budget is not None:
            return self.course.minor(float(budget))
        if not quotes or not isinstance(trials, int):
            raise CourseError("this sweep's trials cannot all be quoted before it starts (ranges,"
                              f" or more than {SWEEP_QUOTES} grid points): give budget=N, the "
                              f"most the whole sweep may cost in {self.course.currency}")
        if options.get("strategy", "grid") == "grid" and trials == size:
            return sum(quotes)
        return trials * max(quotes)

    # -- following and stopping ------------------------------------------------------------------
    def _visible(self, user: str, sweep_id: str) -> RunHold:
        h = self.ledger.run_hold(sweep_id, kinds=("sweep",))
        if h.student != user and not self.desk.is_instructor(user):
            raise Forbidden(f"sweep {sweep_id} is not {user}'s; GET /sweeps lists yours")
        return h

    def view(self, user: str, sweep_id: str) -> dict[str, Any]:
        return self._view(self._visible(user, sweep_id))

    def sweeps(self, user: str) -> list[dict[str, Any]]:
        who = None if self.desk.is_instructor(user) else self.desk._student(user)
        return [self._view(h) for h in self.ledger.holds(who) if h.kind == "sweep"]

    def _view(self, h: RunHold) -> dict[str, Any]:
        charged = self.ledger.charged_trials(h.hold_id)
        try:
            data = SweepRecord(h.run_dir or "").read()
        except (WorkbenchError, OSError, ValueError):  # its folder is gone: the ledger says why
            data = {"trials": [], "note": next(
                (e["note"] for e in self.ledger.entries(h.student)
                 if e["hold_id"] == h.hold_id and e["kind"] == "release"), None)}
        trials = [{**{k: t.get(k) for k in ("number", "params", "state", "run_id", "cost",
                                            "value", "limit")},
                   "charge": charged.get(t.get("run_id") or "")} for t in data["trials"]]
        return {"sweep": h.run_id, "student": h.student, "state": data.get("state"),
                "note": data.get("note"), "error": data.get("error"), "hold": h.amount,
                "left": None if h.charge is not None else self.ledger.hold_left(h.hold_id),
                "charged": sum(charged.values()), "settled": h.charge is not None,
                "trials": trials, "currency": self.course.currency}

    def stop(self, user: str, sweep_id: str) -> dict[str, Any]:
        """Cancel the sweep (its running trials too); settle() charges them and releases the
        rest once they have ended."""
        h = self._visible(user, sweep_id)
        state = Sweep(SweepRecord(h.run_dir or "")).cancel()
        return {"sweep": sweep_id, "state": state}

    # -- settling ---------------------------------------------------------------------------------
    def settle(self) -> list[str]:
        """Charge every ended trial of every open sweep hold; resume a sweep whose controller
        died, or end it when it cannot go on; release a hold whose sweep ended with every trial's
        bill in. The ids charged, resumed or released."""
        done: list[str] = []
        for h in self.ledger.holds(open_only=True):
            if h.kind != "sweep" or not h.run_dir:
                continue
            try:
                done += self._settle_one(h, SweepRecord(h.run_dir))
            except Exception:  # one broken sweep must not stop the others' settling
                log.exception("settling sweep %s failed; the next pass retries", h.run_id)
        return done

    def _settle_one(self, h: RunHold, record: SweepRecord) -> list[str]:
        if not record.path.exists():
            return self._end_without_folder(h)
        try:
            data = record.read()
        except (OSError, ValueError):  # half-written: the next pass
            return []
        done = self._charge_released(h, data)
        if data.get("state") not in ENDED:
            if controller_alive(record):
                return done
            why = self._cannot_resume(data)
            if data.get("stop_request") == "cancel":  # being stopped, or its stop died
                data = self._end(record, data, "it was stopped", state=CANCELLED)
            elif why is None:
                record.write(service_resumes=int(data.get("service_resumes") or 0) + 1)
                Sweep(record).resume()  # its own budget is the hold: it stays within it
                log.info("sweep %s: its controller was gone; resumed", h.run_id)
                return [*done, f"{h.run_id} resumed"]
            else:
                data = self._end(record, data, why)
        return done + self._release_if_over(h, record, data)

    def _charge_released(self, h: RunHold, data: dict[str, Any]) -> list[str]:
        done = []
        for t in data["trials"]:
            # released: the trial's bill is final (or, its supervisor dead, its whole limit).
            if t.get("released") and t.get("run_id") and self._charge(
                    h, t["run_id"], float(t.get("cost") or 0.0),
                    f"trial {t['number']} run {t['run_id']} {t.get('state')}"):
                done.append(t["run_id"])
        return done

    def _charge(self, h: RunHold, run_id: str, cost: float, what: str) -> bool:
        return self.ledger.charge_trial(h.hold_id, run_id, self.course.minor(cost),
                                        actor=SERVICE_ACTOR,
                                        note=f"sweep {h.run_id} {what}") is not None

    @staticmethod
    def _cannot_resume(data: dict[str, Any]) -> str | None:
        """Why a sweep whose controller is gone cannot be resumed, or None when it can."""
        from workbench.spec import RunSpec
        from workbench.sweep.space import parse_space

        resumes = int(data.get("service_resumes") or 0)
        if resumes >= SERVICE_RESUMES:
            return (f"its controller died again after {resumes} resumes by the course service "
                    "(see its controller.log)")
        try:
            parse_space(data["space"], RunSpec.parse(data["spec"]))
        except (WorkbenchError, KeyError, TypeError, ValueError) as exc:
            return f"its spec or space is no longer valid ({exc})"
        return None

    def _end(self, record: Any, data: dict[str, Any], why: str,
             state: str = FAILED) -> dict[str, Any]:
        """End a sweep the service cannot resume: its running trials are cancelled (their bills
        are then charged from their runs) and its record says why."""
        from workbench.runs.jobs import get_job

        for t in data["trials"]:
            if t.get("run_id") and not t.get("released"):
                try:
                    job = get_job(t["run_id"])
                    if not job.done:
                        job.cancel()
                except WorkbenchError:  # never registered: nothing ran under it
                    pass
        if state == CANCELLED:
            return record.write(state=CANCELLED, ended=time.time())
        error = (f"ended by the course service: {why}; the trials that ran are charged and the "
                 "rest of the hold is released")
        log.warning("sweep %s %s", record.id, error)
        return record.write(state=state, ended=time.time(), error=error)

    def _release_if_over(self, h: RunHold, record: Any, data: dict[str, Any]) -> list[str]:
        """Once the sweep has ended and every trial's bill is in, release the rest of its hold.
        A trial its (dead) controller never released is charged its run's own final bill."""
        if data.get("state") not in ENDED:
            return []
        done: list[str] = []
        charged = self.ledger.charged_trials(h.hold_id)
        unbilled = [t for t in data["trials"] if t.get("run_id") and not t.get("released")
                    and t["run_id"] not in charged]
        if unbilled:
            if controller_alive(record):  # it releases them itself
                return []
            for t in unbilled:
                cost = _final_cost(t["run_id"])
                if cost is None:
                    return done  # still stopping: the next pass
                if self._charge(h, t["run_id"], cost, f"trial {t['number']} run "
                                                      f"{t['run_id']} (its controller gone)"):
                    done.append(t["run_id"])
        note = f"sweep {h.run_id} {data.get('state')}: the rest of the hold released"
        if data.get("error"):
            note += f" ({data['error']})"
        if self.ledger.settle(h.hold_id, 0, actor=SERVICE_ACTOR, note=note):
            done.append(str(h.run_id))
        return done

    def _end_without_folder(self, h: RunHold) -> list[str]:
        """The sweep's folder is gone: its trials are found by their runs' sweep tag, stopped and
        charged their final bills; then the rest of the hold is released, the ledger saying why."""
        from workbench.runs.jobs import get_job
        from workbench.runs.registry import Registry

        done: list[str] = []
        pending = False
        for r in Registry().list_runs():
            try:
                job = get_job(r.id)
                if (job.status().get("sweep") or {}).get("id") != h.run_id:
                    continue
                if not job.done:
                    job.cancel()
            except WorkbenchError:
                continue
            cost = _final_cost(r.id)
            if cost is None:
                pending = True
            elif self._charge(h, r.id, cost, f"run {r.id} (its sweep's folder gone)"):
                done.append(r.id)
        note = (f"sweep {h.run_id} ended by the course service: its folder {h.run_dir} is gone, so "
                "it cannot be resumed; its trials' runs are charged and the rest released")
        if not pending and self.ledger.settle(h.hold_id, 0, actor=SERVICE_ACTOR, note=note):
            log.warning("%s", note)
            done.append(str(h.run_id))
        return done


def _final_cost(run_id: str) -> float | None:
    """A trial run's final bill; 0 for a run never registered (nothing ran); None while it has
    not ended and released its resources yet (a run whose supervisor died before releasing them:
    what it last billed, once it has been over for UNRELEASED_SETTLE_S, as a launch's)."""
    from workbench.runs.jobs import get_job
    from workbench.runs.rundir import TERMINAL

    try:
        status = get_job(run_id).status()
    except WorkbenchError:
        return 0.0
    ended = status.get("state") in TERMINAL
    stale = ended and time.time() - float(status.get("ended") or time.time()) > UNRELEASED_SETTLE_S
    if ended and (status.get("released") or stale):
        return float(status.get("cost") or 0.0)
    return None
