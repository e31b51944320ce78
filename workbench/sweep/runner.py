"""``python -m workbench.sweep.runner SWEEP_DIR``: the sweep's controller, detached from the kernel.

The controller asks the study for a trial, prices it with the planner, launches it as an ordinary
run through :func:`workbench.runs.launching.launch` with its own ``budget.limit`` (what the sweep can
still give it), watches it, reports the objective at each evaluation, prunes it when the pruner
says it is clearly worse, and tells the study how it ended. It runs in a session of its own (like
the run supervisor), so a kernel restart does not stop a sweep.

Every step is also resumable from the record and the study: a controller killed at any point is
replaced by ``get_sweep(...).resume()``, which re-attaches to running trials, finds a run whose
launch was cut short through the registry, and never launches a trial twice. One controller at a
time: it holds the record's controller lock (an flock, released by the kernel when it dies).

One budget (:mod:`workbench.sweep.budget`): a trial starts only when its price fits in what the
sweep has neither spent nor holds for the trials under way, with a ``budget.limit`` of what is
left; so the sum of the trials' costs never passes the sweep's limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs import procs
from workbench.runs.jobs import RELEASE_WAIT_S, Job
from workbench.runs.registry import Registry
from workbench.runs.rundir import (
    BUDGET_STOPPED,
    PENDING,
    PRUNE_REQUEST,
    PRUNED,
    SUCCEEDED,
    TERMINAL,
    RunDir,
)
from workbench.spec import RunSpec
from workbench.sweep import record as rec
from workbench.sweep.budget import PRICE_MARGIN, Price, committed, left_s, trial_price
from workbench.sweep.objective import Objective
from workbench.sweep.space import parse_space, trial_spec
from workbench.sweep.study import open_study, suggest, trial_of, trial_of_frozen

POLL_S = 1.0
# How long a resumed controller gives a run registered by a killed launch() to show it was
# submitted (a supervisor started just before the kill records itself a moment later).
LAUNCH_SETTLE_S = 30.0


def start_controller(record: rec.SweepRecord) -> procs.ProcessIdentity:
    """Start the detached controller of ``record`` and record its identity."""
    with record.log_file.open("ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "workbench.sweep.runner", str(record.path)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=record.path, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ident = procs.ProcessIdentity.of(child.pid, "sweep-controller")
    record.write(controller=ident.to_dict())
    return ident


def asked(data: dict[str, Any]) -> int:
    """Trials that count towards trials_total: all but those abandoned inside ask() (_adopt)."""
    return sum(1 for t in data["trials"] if not t.get("abandoned"))


class Controller:
    def __init__(self, record: rec.SweepRecord) -> None:
        self.record = record
        data = record.read()
        self.base = RunSpec.parse(data["spec"])
        self.params = parse_space(data["space"], self.base)
        self.objective = Objective.parse(data["objective"], data["direction"])
        self.study = open_study(record, data["strategy"], self.params, self.objective.direction,
                                data.get("seed"), data.get("pruner", "median"),
                                data.get("prune_after", 2))
        self.registry = Registry()
        self.active: dict[int, Job] = {}
        self.seen_ended: dict[int, float] = {}  # trial -> when its run was first seen ended
        self.stop_launching: str | None = None  # why no more trials start (budget, a fatal error)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        with self.record.controller_lock(wait_s=10.0) as mine:
            if not mine:
                print("controller: another controller runs this sweep; leaving", flush=True)
                return 0
            me = procs.ProcessIdentity.me("sweep-controller")
            self.record.write(controller=me.to_dict(), state=rec.RUNNING, error=None)
            try:
                self._reconcile()
                while True:
                    data = self.record.read()
                    if data.get("stop_request") == "cancel":
                        self._cancel_all()
                        self.record.write(state=rec.CANCELLED, ended=time.time())
                        return 0
                    self._watch()
                    if not self.stop_launching:
                        self._fill()
                    if not self.active and self._done():
                        break
                    time.sleep(POLL_S)
            except Exception as exc:
                traceback.print_exc()
                self.record.write(state=rec.FAILED, ended=time.time(),
                                  error=f"the sweep controller stopped: {exc}; see "
                                        f"{self.record.log_file}; get_sweep(...).resume() goes on")
                return 1
            data = self.record.read()
            state = {None: rec.SUCCEEDED, "budget": rec.BUDGET_STOPPED}.get(self.stop_launching,
                                                                             rec.FAILED)
            self.record.write(state=data.get("state") if data.get("error") else state,
                              ended=time.time(), spent=committed(data))
            return 0

    def _done(self) -> bool:
        data = self.record.read()
        if self.stop_launching:
            return True
        waiting = [t for t in data["trials"] if t.get("state") == rec.WAITING]
        return not waiting and asked(data) >= data["trials_total"]

    # -- starting -------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Pick up where a dead controller left: the record and the study agree again (every
        trial the study was asked for is in the record, every trial that ended in the record was
        told to the study), runs are re-attached and launches cut short are found."""
        import optuna

        data = self.record.read()
        known = {t["number"] for t in data["trials"]}
        for ft in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if ft.number not in known:  # asked, then killed before the record had it
                self._adopt(ft.number)
        for t in self.record.read()["trials"]:
            if t.get("released") or t.get("state") == rec.SKIPPED:
                self._tell(t)  # ended in the record, maybe killed before the study was told
                continue
            if t.get("state") == rec.WAITING:
                continue
            run_id = t.get("run_id")
            if run_id is None:  # launch() may have registered the run before we were killed
                run_id = self._find_launched(t)
                if run_id is None:
                    self.record.update_trial(t["number"], state=rec.WAITING, limit=None)
                    continue
                self.record.update_trial(t["number"], run_id=run_id)
            self.active[t["number"]] = Job(self.registry.get_run(run_id), registry=self.registry)

    def _adopt(self, number: int) -> None:
        """Put the study's trial ``number``, asked by a controller killed before it wrote it down,
        into the record as waiting, with the settings the sampler gave it (or gives it now)."""
        try:
            params = suggest(trial_of(self.study, number), self.params)
        except ValueError as exc:  # killed inside ask(): the grid sampler never gave it a point
            self.record.update_trial(number, state=rec.FAILED, released=True, cost=0.0,
                                     abandoned=True, error=f"asked by a controller killed before "
                                     f"the sampler chose its settings ({exc}); not run")
            self.study.tell(number, state=self._optuna_state(rec.FAILED), skip_if_finished=True)
            return
        self.record.update_trial(number, params=params, run_name=self._run_name(number),
                                 state=rec.WAITING)

    def _find_launched(self, t: dict[str, Any]) -> str | None:
        """The run of a trial whose launch() was cut short, if launch() got as far as handing it
        to the backend; a run registered but never submitted is removed (as launch() removes
        one it refuses), so the trial starts afresh."""
        try:
            run = self.registry.get_run(t["run_name"])
        except WorkbenchError:
            return None
        rd = RunDir(run.run_dir)
        # A supervisor started just before the kill records itself a moment later.
        deadline = time.time() + LAUNCH_SETTLE_S
        while not self._submitted(run.backend_job_id, rd) and time.time() < deadline:
            time.sleep(POLL_S)
            run = self.registry.get_run(run.id)
        if self._submitted(run.backend_job_id, rd):
            return run.id
        print(f"controller: trial {t['number']}: run {run.id} was registered but never "
              "submitted (the launch was cut short); removing it and starting the trial again",
              flush=True)
        self.registry.delete_run(run.id)
        shutil.rmtree(rd.path, ignore_errors=True)
        return None

    @staticmethod
    def _submitted(job_id: str | None, rd: RunDir) -> bool:
        status = rd.status()
        return bool(job_id or status.get("submitted") or status.get("processes")
                    or status.get("state") not in (None, PENDING))

    @staticmethod
    def _optuna_state(state: str) -> Any:
        import optuna

        if state in (PRUNED, BUDGET_STOPPED):  # stopped early: its intermediate values stand
            return optuna.trial.TrialState.PRUNED
        return optuna.trial.TrialState.FAIL

    def _tell(self, t: dict[str, Any]) -> None:
        """Tell the study how the trial ``t`` of the record ended (nothing if it was told)."""
        if t.get("state") == SUCCEEDED and t.get("value") is not None:
            self.study.tell(t["number"], t["value"], skip_if_finished=True)
        else:
            self.study.tell(t["number"], state=self._optuna_state(t.get("state", rec.FAILED)),
                            skip_if_finished=True)

    def _run_name(self, number: int) -> str:
        tag = self.record.id.rsplit("-", 1)[-1]
        return f"{self.base.name[:50]}-{tag}-t{number}"

    def _next_waiting(self) -> dict[str, Any] | None:
        data = self.record.read()
        for t in data["trials"]:
            if t.get("state") == rec.WAITING:
                return t
        if asked(data) >= data["trials_total"]:
            return None
        # Killed between ask() and the record, the next controller adopts the trial (_adopt).
        trial = self.study.ask()
        params = suggest(trial, self.params)
        name = self._run_name(trial.number)
        self.record.update_trial(trial.number, params=params, run_name=name, state=rec.WAITING)
        return {"number": trial.number, "params": params, "run_name": name}

    def _fill(self) -> None:
        data = self.record.read()
        while len(self.active) < data["concurrent"]:
            t = self._next_waiting()
            if t is None:
                return
            spec = trial_spec(self.base, t["params"]).updated(name=t["run_name"])
            data = self.record.read()
            started = sum(1 for x in data["trials"] if x.get("run_id") or x.get("released"))
            to_start = max(1, data["trials_total"] - started)
            # Priced for the trials it will run beside: they share this machine's cores.
            now = time.time()
            price = trial_price(spec, [left_s(x, now, float("inf")) for x in data["trials"]
                                       if x["number"] in self.active], to_start - 1,
                                data["concurrent"])
            need = price.need
            limit = data.get("budget")
            trial_limit = spec.budget.limit
            if limit is not None:
                left = float(limit) - committed(data)
                if need > left:
                    if self.active:  # a running trial may end under its limit: wait for it
                        return
                    self._budget_spent(left, need)
                    return
                free = max(1, min(data["concurrent"] - len(self.active), to_start))
                trial_limit = min(left, max(need, left / free))
                spec = spec.updated(**{"budget.limit": trial_limit})
            if not self._launch(t, spec, price, trial_limit):
                return

    def _launch(self, t: dict[str, Any], spec: RunSpec, price: Price, limit: float | None) -> bool:
        """Start trial ``t``; False when the wallet cannot cover it (it waits for a running
        trial to settle, or, with none running, the sweep ends as when its budget is spent)."""
        from workbench.errors import CreditError
        from workbench.runs.launching import launch

        n = t["number"]
        planned = price.planned
        self.record.update_trial(n, state=rec.LAUNCHING, limit=limit, planned_cost=planned,
                                 launched=time.time(), sharing=price.shared,
                                 alone_s=price.alone_s)
        try:
            job = launch(spec, registry=self.registry)
        except CreditError as exc:  # the owner's wallet (workbench.runs.wallet) is short
            self.record.update_trial(n, state=rec.WAITING)
            if not self.active:
                self._budget_spent(0.0, planned or 0.0, why=f"wallet: {exc}")
            return False
        except WorkbenchError as exc:
            data = self.record.update_trial(n, state=rec.FAILED, error=str(exc), released=True,
                                            cost=0.0)
            self._tell(next(x for x in data["trials"] if x["number"] == n))
            print(f"controller: trial {n} could not start: {exc}", flush=True)
            return True
        job.run_dir.write_status(sweep={"id": self.record.id, "trial": n, "sharing": price.shared})
        self.record.update_trial(n, run_id=job.id, state=job.record.state)
        self.active[n] = job
        print(f"controller: trial {n} started as {job.id} {t['params']} limit {limit}", flush=True)
        return True

    def _budget_spent(self, left: float, need: float, why: str | None = None) -> None:
        """Nothing runs and what is left cannot pay for the next trial: the sweep ends here."""
        data = self.record.read()
        for t in data["trials"]:
            if t.get("state") == rec.WAITING:
                # The record first: a controller killed in between tells the study (_reconcile).
                self.record.update_trial(t["number"], state=rec.SKIPPED, released=True, cost=0.0)
                self._tell({**t, "state": rec.SKIPPED})
        cur = data.get("currency", "")
        self.record.write(note=why or (
            f"budget: {left:.4g} {cur} left of {data['budget']:g}, but the next trial is priced "
            f"at {need:.4g} {cur} (planner estimate x {PRICE_MARGIN} + start and release); no "
            "more trials start"))
        self.stop_launching = "budget"

    # -- watching ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        for n, job in list(self.active.items()):
            status = job.status()
            state = status.get("state")
            if state not in TERMINAL:
                self._report(n, job)
                continue
            # A run that recorded no end time is timed from when it was first seen ended (now
            # would restart the wait at every poll, and the bill would be waited for forever).
            ended = float(status.get("ended") or self.seen_ended.setdefault(n, time.time()))
            if "released" not in status and time.time() - ended < RELEASE_WAIT_S:
                continue  # the supervisor is writing the final bill
            self._finish(n, job, status)

    def _report(self, n: int, job: Job, prune: bool = True) -> None:
        """Report the objective's new intermediate values; prune the trial if it is clearly worse."""
        frozen = trial_of_frozen(self.study, n)
        if frozen.state.is_finished():  # told already (by a controller killed after telling)
            return
        trial = trial_of(self.study, n)
        seen = set(frozen.intermediate_values)
        for step, value in self.objective.intermediate(job.run_dir.path):
            if step not in seen:
                trial.report(value, step)
                seen.add(step)
        if not prune or not seen or job.run_dir.status().get("stop_request"):
            return
        if trial.should_prune():
            print(f"controller: pruning trial {n} ({job.id})", flush=True)
            self.record.update_trial(n, prune_requested=time.time())
            try:
                # The backend records the reason where the run's supervisor reads it (on the
                # target), then stops the run: it ends "pruned", not "cancelled".
                job.cancel(stop_request=PRUNE_REQUEST)
            except WorkbenchError as exc:  # unconfirmed (host unreachable): asked again next poll
                print(f"controller: trial {n}: the prune is not confirmed yet: {exc}", flush=True)

    def _finish(self, n: int, job: Job, status: dict[str, Any]) -> None:
        state = status["state"]
        self._report(n, job, prune=False)
        value = self.objective.final(job.run_dir.path) if state == SUCCEEDED else None
        data = self.record.read()
        trial = next(t for t in data["trials"] if t["number"] == n)
        # A bill that was never closed (the supervisor died) counts as the whole limit.
        cost = status.get("cost") if "released" in status else trial.get("limit")
        fields: dict[str, Any] = {"state": state, "cost": float(cost or 0.0), "value": value,
                                  "released": True, "cost_final": "released" in status}
        if value is None:  # stopped early (pruned, budget): the objective it last reached
            seen = self.objective.intermediate(job.run_dir.path)
            if seen:
                fields["last"] = {"step": seen[-1][0], "value": seen[-1][1]}
        if state == SUCCEEDED and value is None:
            said = self.objective.reported(job.run_dir.path)
            error = (f"objective {self.objective.name!r} was not reported by trial {n} "
                     f"({job.id}), which succeeded; it reported "
                     f"{', '.join(said) or 'nothing usable'}. Give objective= one of those, "
                     f"or configure the evaluation that reports it")
            fields["error"] = error
            self.record.write(state=rec.FAILED, error=error)
            self.stop_launching = "objective"
            self._cancel_all(but=n)
        # The record first, then the study: a controller killed in between leaves a trial that
        # ended in the record, which the next one tells the study (_reconcile); never the reverse
        # (a trial told, but still running in the record, would be watched and told again).
        self.record.update_trial(n, **fields)
        self._tell({"number": n, **fields})
        self.active.pop(n, None)
        print(f"controller: trial {n} ended {state} value {value} cost {cost}", flush=True)

    def _cancel_all(self, but: int | None = None) -> None:
        for n, job in list(self.active.items()):
            if n != but:
                job.cancel()
        # Their final bills are read as they end; the loop's _watch finishes them.
        deadline = time.time() + RELEASE_WAIT_S
        while any(n != but for n in self.active) and time.time() < deadline:
            for n, job in list(self.active.items()):
                status = job.status()
                if n != but and status.get("state") in TERMINAL and "released" in status:
                    self._finish(n, job, status)
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workbench.sweep.runner SWEEP_DIR", file=sys.stderr)
        return 2
    return Controller(rec.SweepRecord(args[0])).run()


if __name__ == "__main__":
    sys.exit(main())
