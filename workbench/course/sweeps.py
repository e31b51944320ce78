"""Course sweeps: a student's sweep, run as the student, held against their credit as a whole and
charged trial by trial from the service's own meter.

1. The space is checked (a course sets ``budget.*`` and ``resources.*`` itself; a sweep varies
   ``train.*``, ``method.*`` but not rewards, ``data.*`` but not sources or cleaning), the spec is
   admitted like a launch's (:func:`~workbench.course.policy.admit`, the student's own space),
   every discrete trial is quoted like a launch (caps included), and the sweep's whole budget is
   held: the ``budget`` asked, or the quoted total of the trials. A hold the credit cannot take is
   refused (402) before anything is written.
2. The worker starts the ordinary sweep (:func:`workbench.sweep.start.sweep`) as the student, in
   their space, with its ``budget`` equal to the hold, so its controller starts a trial only when
   the trial's price fits what is left; its trials start without a standby. The service meters
   the controller it started and every trial it spawns (:mod:`workbench.course.sweep_meter`).
3. :meth:`CourseSweeps.settle` (when the service starts and every few seconds) ticks each open
   sweep's meter and charges each ended trial its metered bill against the hold
   (:meth:`Ledger.charge_trial`, once per trial process). Once none of the sweep's processes is
   left, a sweep whose controller died (the student's sweep.json says neither ended nor stopped)
   is resumed as the student, at most ``SERVICE_RESUMES`` times; otherwise the rest of the hold is
   released. The sweep's files are the student's: they name trials and show progress, and decide
   nothing about money.

Students see and stop only their own sweeps; instructors any. A stop is final: the student's
controller is asked to cancel, and whatever of the sweep still runs ``STOP_KILL_S`` later is killed.
"""

from __future__ import annotations

import logging
import pwd
import signal
import time
from typing import Any

from workbench.course.desk import (
    SERVICE_ACTOR,
    SWEEP_QUOTES,
    CourseDesk,
    Forbidden,
)
from workbench.course.students import Worker, read_json, space
from workbench.course.sweep_meter import SweepAttempt, SweepMeter, attempt_view
from workbench.errors import CourseError
from workbench.runs.ledger import RunHold
from workbench.sweep.record import ENDED

# sweep()'s keyword arguments a student may give (target goes in the spec).
OPTIONS = ("strategy", "trials", "objective", "direction", "budget", "concurrent", "seed",
           "pruner", "prune_after")
COURSE_SET = ("budget.", "resources.")  # space paths the course decides, not the sweep
SWEEPABLE = ("train.", "method.", "data.")
NOT_SWEEPABLE = ("method.rewards", "data.sources", "data.clean")
# Times the service resumes one sweep whose controller died before it ends it instead (a
# controller that dies at every start must not be restarted forever).
SERVICE_RESUMES = 3
STOP_KILL_S = 60.0  # a stopped sweep's processes still running this long after are killed
log = logging.getLogger("workbench.course")


class CourseSweeps:
    def __init__(self, desk: CourseDesk) -> None:
        self.desk, self.course, self.ledger = desk, desk.course, desk.ledger
        self.meter = SweepMeter(self.course)

    # -- starting --------------------------------------------------------------------------------
    def start(self, user: str, spec: Any, sweep_space: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Hold the sweep's budget, then start it as the student with that budget; a refused hold
        starts nothing and writes no sweep directory."""
        from workbench.course.policy import admit, cards, hourly_rate

        student = self.desk._student(user)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise CourseError(f"a course sweep takes {', '.join(OPTIONS)}, not {unknown}")
        concurrent = options.get("concurrent", 1)
        if isinstance(concurrent, bool) or not isinstance(concurrent, int) or concurrent < 1:
            raise CourseError(f"concurrent must be a whole number of trials at once, not "
                              f"{concurrent!r}")
        with self.desk._lock(student):
            base = admit(self.course, str(space(self.course, student)), spec)
            self.desk._check_concurrent(student, more=concurrent)
            amount = self._amount(student, base, sweep_space, options)
            hold_id = self.desk._hold(student, amount, f"sweep {base.name}")
            request = {"verb": "sweep", "spec": base.model_dump(mode="json"),
                       "sweep_space": sweep_space,
                       "options": {**options, "budget": amount / self.course.minor_per_unit}}
            try:
                answer = Worker(self.course, student, request, gpus=cards(base) > 0,
                                env={"WORKBENCH_STANDBY": "0"}).answer()
            except BaseException:
                self.ledger.settle(hold_id, 0, actor=SERVICE_ACTOR, note="sweep refused")
                raise
            self.ledger.attach_run(hold_id, answer["sweep"], answer["record"], kind="sweep")
            a = SweepAttempt(hold_id, student, pwd.getpwnam(student).pw_uid, answer["sweep"],
                             hourly_rate(base), amount, concurrent, cards(base) > 0,
                             {"spec": request["spec"], "space": sweep_space})
            if answer.get("controller"):
                self.meter.add_controller(a, tuple(answer["controller"]))  # type: ignore[arg-type]
            else:
                self.meter.save(a)
        return {"sweep": answer["sweep"], "student": student, "hold": amount,
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
        """The sweep as its (student-written) record shows it, with what the meter billed."""
        data = self._record(h)
        a = self.meter.get(h.hold_id)
        billed = attempt_view(self.meter, a)
        trials = [{**{k: t.get(k) for k in ("number", "params", "state", "run_id", "value",
                                            "limit")},
                   "charge": billed.get(str(t.get("run_id")))}
                  for t in data.get("trials") or [] if isinstance(t, dict)]
        charged = self.ledger.charged_trials(h.hold_id)
        return {"sweep": h.run_id, "student": h.student, "state": data.get("state"),
                "note": data.get("note"), "error": data.get("error") or (a.why if a else None),
                "hold": h.amount,
                "left": None if h.charge is not None else self.ledger.hold_left(h.hold_id),
                "charged": sum(charged.values()), "settled": h.charge is not None,
                "trials": trials, "currency": self.course.currency}

    def _record(self, h: RunHold) -> dict[str, Any]:
        """The student's sweep.json, read only if it is the student's own file."""
        return read_json(f"{h.run_dir}/sweep.json", h.student) if h.run_dir else {}

    def stop(self, user: str, sweep_id: str) -> dict[str, Any]:
        """Cancel the sweep as its student; the meter bills its trials until their processes
        ended, and kills what still runs ``STOP_KILL_S`` later."""
        h = self._visible(user, sweep_id)
        a = self.meter.get(h.hold_id)
        if a is not None and a.stopping is None:
            a.stopping, a.why = time.time(), f"stopped by {user}"
            self.meter.save(a)
        state = "cancelled"
        try:
            state = str(Worker(self.course, h.student, {"verb": "sweep_cancel", "sweep": sweep_id,
                                                        "wait_s": 30}).answer()["state"])
        except CourseError as exc:  # its files are gone or broken: the meter stops it
            log.warning("sweep %s: the student's cancel failed (%s); stopping it", sweep_id, exc)
            if a is not None:
                self.meter.stop(a, signal.SIGTERM)
        return {"sweep": sweep_id, "state": state}

    # -- settling ---------------------------------------------------------------------------------
    def settle(self) -> list[str]:
        """Meter every open sweep, charge its ended trials; resume a sweep whose controller died,
        or release the rest of a hold whose sweep has nothing left running. The ids charged,
        resumed or released."""
        done: list[str] = []
        for h in self.ledger.holds(open_only=True):
            if h.kind != "sweep" or not h.run_id:
                continue
            try:
                done += self._settle_one(h)
            except Exception:  # one broken sweep must not stop the others' settling
                log.exception("settling sweep %s failed; the next pass retries", h.run_id)
        return done

    def _settle_one(self, h: RunHold) -> list[str]:
        a = self.meter.get(h.hold_id)
        if a is None:  # started moments ago (its meter is written next), or never started
            if time.time() - h.at > 60:
                self.ledger.settle(h.hold_id, 0, actor=SERVICE_ACTOR,
                                   note=f"sweep {h.run_id}: nothing of it ran")
                return [str(h.run_id)]
            return []
        now = time.time()
        # The trials' run ids and the names given them before their launch, from the student's
        # record (a label: naming more only adds processes of theirs to their own bill).
        runs = {str(t.get(key)) for t in self._record(h).get("trials") or []
                if isinstance(t, dict) for key in ("run_id", "run_name") if t.get(key)}
        trials, controllers = self.meter.tick(a, now, runs)
        if (trials or controllers) and a.stopping is not None and now - a.stopping >= STOP_KILL_S:
            self.meter.stop(a, signal.SIGKILL)  # a stop is final
        done = self._charge_ended(h, a)
        if controllers:
            return done
        data = self._record(h)
        ended = data.get("state") in ENDED or data.get("stop_request") == "cancel"
        if a.stopping is None and not a.why and not ended and a.resumes < SERVICE_RESUMES:
            return done + self._resume(h, a)
        if trials:
            if a.stopping is None and not ended:  # no controller will ever end them: stop them
                a.stopping, a.why = now, (a.why or f"its controller died again after {a.resumes} "
                                          "resumes by the course service")
                self.meter.stop(a, signal.SIGTERM)
                self.meter.save(a)
            return done
        note = f"sweep {h.run_id} {data.get('state') or 'ended'}: the rest of the hold released"
        if a.why:
            note += f" ({a.why})"
        if self.ledger.settle(h.hold_id, 0, actor=SERVICE_ACTOR, note=note):
            done.append(str(h.run_id))
        a.ended = now
        self.meter.save(a)
        return done

    def _charge_ended(self, h: RunHold, a: SweepAttempt) -> list[str]:
        done = []
        for key, t in a.trials.items():
            if t.end is None or t.charged:
                continue
            note = (f"sweep {h.run_id} trial {t.run or key}: {t.end - t.start:.0f} s metered at "
                    f"{a.rate:g} {self.course.currency}/h")
            if self.ledger.charge_trial(h.hold_id, key, self.meter.trial_bill(a, t),
                                        actor=SERVICE_ACTOR, note=note) is not None:
                done.append(t.run or key)
            t.charged = True
            self.meter.save(a)
        return done

    def _resume(self, h: RunHold, a: SweepAttempt) -> list[str]:
        """The sweep's controller died with its sweep not ended: resume it as the student."""
        a.resumes += 1
        self.meter.save(a)
        try:
            # The worker resumes only the spec and space the course admitted (sweep.json is the
            # student's file).
            answer = Worker(self.course, a.student, {"verb": "sweep_resume", "sweep": h.run_id,
                                                     "admitted": a.admitted},
                            gpus=a.gpus, env={"WORKBENCH_STANDBY": "0"}).answer()
        except CourseError as exc:
            a.why = f"it could not be resumed ({exc})"
            self.meter.save(a)
            return []
        if answer.get("controller"):
            self.meter.add_controller(a, tuple(answer["controller"]))  # type: ignore[arg-type]
        log.info("sweep %s: its controller was gone; resumed as %s", h.run_id, a.student)
        return [f"{h.run_id} resumed"]
