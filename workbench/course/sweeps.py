"""Course sweeps: a student's sweep held against their credit as a whole, trial by trial charged.

The service starts the ordinary sweep (:func:`workbench.sweep.start.sweep`, its detached
controller and runs, in the service's WORKBENCH_HOME); this module only owns the money around it:

1. the space is checked (a course sets ``budget.*`` and ``resources.*`` itself), every discrete
   trial is quoted like a launch (caps included), and the sweep's whole budget is held: the
   ``budget`` asked, or the quoted total of the trials. A hold the credit cannot take is refused
   (402) before anything is written;
2. the sweep runs with its ``budget`` equal to the hold, so its controller starts a trial only when
   the trial's price fits what is left of it and gives each trial a ``budget.limit`` within it;
3. :meth:`CourseSweeps.settle` (run by the service every few seconds) charges each trial's final
   bill against the hold as the trial ends (:meth:`Ledger.charge_trial`), and releases the rest
   once the sweep has ended or was stopped.

Students see and stop only their own sweeps; instructors any.
"""

from __future__ import annotations

from typing import Any

from workbench.course.desk import SERVICE_ACTOR, SWEEP_QUOTES, CourseDesk, Forbidden
from workbench.course.ledger import RunHold
from workbench.errors import CourseError, WorkbenchError

# sweep()'s keyword arguments a student may give (target goes in the spec).
OPTIONS = ("strategy", "trials", "objective", "direction", "budget", "concurrent", "seed",
           "pruner", "prune_after")
COURSE_SET = ("budget.", "resources.")  # space paths the course decides, not the sweep


class CourseSweeps:
    def __init__(self, desk: CourseDesk) -> None:
        self.desk, self.course, self.ledger = desk, desk.course, desk.ledger

    # -- starting --------------------------------------------------------------------------------
    def start(self, user: str, spec: Any, space: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Hold the sweep's budget, then start the sweep with that budget; a refused hold starts
        nothing and writes no sweep directory."""
        from workbench.course.policy import priced_spec
        from workbench.spec import RunSpec
        from workbench.sweep.start import sweep

        student = self.desk._student(user)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise CourseError(f"a course sweep takes {', '.join(OPTIONS)}, not {unknown}")
        with self.desk._lock(student):
            base = priced_spec(self.course, RunSpec.coerce(spec))
            concurrent = options.get("concurrent", 1)
            if isinstance(concurrent, int) and not isinstance(concurrent, bool):
                self.desk._check_concurrent(student, more=concurrent)
            amount = self._amount(student, base, space, options)
            hold_id = self.desk._hold(student, amount, f"sweep {base.name}")
            try:
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
            quotes = [self.desk.quote(student, base.updated(**c))["hold"] for c in changes]
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
        from workbench.sweep.record import SweepRecord

        charged = self.ledger.charged_trials(h.hold_id)
        try:
            data = SweepRecord(h.run_dir or "").read()
        except (WorkbenchError, OSError, ValueError):
            data = {"trials": []}
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
        from workbench.sweep.handle import Sweep
        from workbench.sweep.record import SweepRecord

        h = self._visible(user, sweep_id)
        state = Sweep(SweepRecord(h.run_dir or "")).cancel()
        return {"sweep": sweep_id, "state": state}

    # -- settling --------------------------------------------------------------------------------
    def settle(self) -> list[str]:
        """Charge every ended trial of every open sweep hold; release a hold whose sweep ended
        with every trial's bill in. The ids charged or released."""
        from workbench.sweep.record import ENDED, SweepRecord

        done = []
        for h in self.ledger.holds(open_only=True):
            if h.kind != "sweep" or not h.run_dir:
                continue
            try:
                data = SweepRecord(h.run_dir).read()
            except (OSError, ValueError):  # its folder is gone or half-written: the next pass
                continue
            for t in data["trials"]:
                # released: the trial's bill is final (or, its supervisor dead, its whole limit).
                if t.get("released") and t.get("run_id"):
                    charge = self.course.minor(float(t.get("cost") or 0.0))
                    if self.ledger.charge_trial(h.hold_id, t["run_id"], charge,
                                                actor=SERVICE_ACTOR,
                                                note=f"sweep {h.run_id} trial {t['number']} run "
                                                     f"{t['run_id']} {t.get('state')}") is not None:
                        done.append(t["run_id"])
            running = [t for t in data["trials"] if t.get("run_id") and not t.get("released")]
            note = f"sweep {h.run_id} {data.get('state')}: the rest of the hold released"
            if data.get("state") in ENDED and not running \
                    and self.ledger.settle(h.hold_id, 0, actor=SERVICE_ACTOR, note=note):
                done.append(str(h.run_id))
        return done
