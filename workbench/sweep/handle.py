"""The Sweep handle: one sweep's state, trials, best result, spend, wait, resume, cancel and view.

    >>> s = get_sweep("lr-search")        # doctest: +SKIP   (by id, name or id prefix)
    >>> s.wait(); s.trials_df()           # doctest: +SKIP
    >>> s.best["params"]                  # doctest: +SKIP

A Sweep reads everything from its record (workbench.sweep.record) and its trials' runs, so one
found again after a kernel restart is as good as the one ``workbench.sweep`` returned.
"""

from __future__ import annotations

import time
from typing import Any

from workbench.errors import SweepError
from workbench.runs.jobs import Job
from workbench.runs.registry import Registry
from workbench.sweep import budget
from workbench.sweep import record as rec


def get_sweep(id_or_name: str) -> Sweep:
    """Find a sweep again (by id, name, or unique id prefix), e.g. after a kernel restart."""
    return Sweep(rec.find_sweep(id_or_name))


def sweeps() -> list[Sweep]:
    """Every sweep, newest first."""
    return [Sweep(r) for r in rec.list_sweeps()]


class Sweep:
    def __init__(self, record: rec.SweepRecord) -> None:
        self.record = record

    id = property(lambda self: self.record.id)

    def __repr__(self) -> str:
        return f"<Sweep {self.id} {self.state}>"

    def data(self) -> dict[str, Any]:
        """sweep.json as it is now."""
        return self.record.read()

    @property
    def state(self) -> str:
        return str(self.data().get("state"))

    @property
    def done(self) -> bool:
        return self.state in rec.ENDED

    @property
    def controller_alive(self) -> bool:
        return rec.controller_alive(self.record)

    @property
    def spent(self) -> float:
        """What the sweep has spent: the final bills of its ended trials."""
        return budget.spent(self.data())

    @property
    def held(self) -> float:
        """What the sweep holds for its trials under way (their limits): promised, not spent."""
        return budget.held(self.data())

    def money(self, data: dict[str, Any] | None = None) -> str:
        """'spent 12.3 · held 40 of 100 CNY': spent and held apart, against the budget."""
        return budget.money(data or self.data())

    @property
    def trials(self) -> list[dict[str, Any]]:
        return list(self.data()["trials"])

    def jobs(self) -> list[Job]:
        """The trials' runs (Job handles), in trial order; trials not started have none."""
        registry = Registry()
        return [Job(registry.get_run(t["run_id"]), registry=registry)
                for t in sorted(self.trials, key=lambda t: t["number"]) if t.get("run_id")]

    def trials_df(self) -> Any:
        """One row per trial: number, state, each parameter, value, planned cost (priced for the
        trials it ran beside), final cost, limit, run id; a trial stopped early (pruned) has no
        value but the objective it last reached, and at which step (``OBJECTIVE (last seen)``),
        so the table agrees with its run's own curve."""
        import pandas as pd

        data = self.data()
        objective = data["objective"]
        rows = []
        for t in sorted(data["trials"], key=lambda t: t["number"]):
            last = t.get("last") or {}
            rows.append({"trial": t["number"], "state": t.get("state"), **t.get("params", {}),
                         objective: t.get("value"),
                         f"{objective} (last seen)": (f"{last['value']:.4g} at step {last['step']}"
                                                      if last else None),
                         "planned": t.get("planned_cost"), "cost": t.get("cost"),
                         "limit": t.get("limit"), "run_id": t.get("run_id")})
        columns = ["trial", "state", *data["space"], objective, f"{objective} (last seen)",
                   "planned", "cost", "limit", "run_id"]
        return pd.DataFrame(rows, columns=columns)

    @property
    def best(self) -> dict[str, Any]:
        """The best completed trial: {trial, value, params, run_id, job}. A trial counts once it
        has a value and the run it came from (a record mended by hand may lack the run)."""
        data = self.data()
        done = [t for t in data["trials"] if t.get("value") is not None and t.get("run_id")]
        if not done:
            raise SweepError(f"sweep {self.id} has no trial with a value of "
                             f"{data['objective']!r} yet (state {data.get('state')}"
                             + (f": {data['error']}" if data.get("error") else "") + ")")
        pick = min if data["direction"] == "minimize" else max
        t = pick(done, key=lambda t: t["value"])
        return {"trial": t["number"], "value": t["value"], "params": t["params"],
                "run_id": t["run_id"], "job": Job(Registry().get_run(t["run_id"]))}

    # -- control ---------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, progress: bool = True, poll: float = 1.0) -> str:
        """Block until the sweep ends (or ``timeout`` seconds pass); return its state.

        Raises SweepError when the controller is gone before the sweep ended (killed, or the
        machine restarted): ``resume()`` then goes on.
        """
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.time() + timeout
        total = self.data()["trials_total"]
        bar = tqdm(total=total, desc=self.id, unit="trial") if progress else None
        try:
            while True:
                data = self.data()
                ended = sum(1 for t in data["trials"] if t.get("released"))
                if bar is not None:
                    bar.n = ended
                    bar.set_postfix_str(f"{data['state']}, {self.money(data)}", refresh=True)
                if data["state"] in rec.ENDED:
                    return str(data["state"])
                if not self.controller_alive and self.data()["state"] not in rec.ENDED:
                    raise SweepError(f"the controller of sweep {self.id} is gone before the sweep "
                                     f"ended (see {self.record.log_file}); "
                                     f"get_sweep({self.id!r}).resume() goes on from where it was")
                if deadline is not None and time.time() > deadline:
                    return str(data["state"])
                time.sleep(poll)
        finally:
            if bar is not None:
                bar.close()

    def resume(self) -> Sweep:
        """Go on with a sweep whose controller is gone: running trials are watched again,
        finished ones are kept, and the rest are started. A sweep that ended or whose controller
        still runs is left as it is."""
        data = self.data()
        if data["state"] in (rec.SUCCEEDED, rec.BUDGET_STOPPED, rec.CANCELLED):
            return self
        if self.controller_alive:
            return self
        from workbench.sweep.runner import start_controller

        self.record.write(state=rec.RUNNING, error=None, stop_request=None, ended=None)
        start_controller(self.record)
        return self

    def cancel(self, timeout: float = 120.0) -> str:
        """Stop the sweep: its running trials are cancelled; no more start."""
        self.record.write(stop_request="cancel")
        deadline = time.time() + timeout
        while time.time() < deadline and self.controller_alive:
            time.sleep(0.5)
        if not self.done:  # no controller to do it: stop the trials from here
            for job in self.jobs():
                if not job.done:
                    job.cancel()
            self.record.write(state=rec.CANCELLED, ended=time.time())
        return self.state

    # -- views -----------------------------------------------------------------------------------
    def show(self) -> Any:
        """A live widget: trials table, metric against each parameter, best curve, compare."""
        from workbench.sweep.widget import SweepView

        return SweepView(self)

    def _repr_html_(self) -> str:
        import html

        data = self.data()
        head = (f"<b>{html.escape(self.id)}</b> {html.escape(str(data['state']))} · "
                f"{html.escape(self.money(data))}")
        return head + self.trials_df().to_html(index=False, na_rep="")
