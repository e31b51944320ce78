"""The Job handle: one run's state, metrics, logs, wait, resume, cancel and views.

    >>> job = get_job("quickstart")                      # doctest: +SKIP
    >>> job.wait()                                       # doctest: +SKIP
    'succeeded'
    >>> job.metrics_df()[["step", "loss"]].tail(1)       # doctest: +SKIP

A Job reads everything from the run directory (through the backend), so a Job found again after a
kernel restart (``jobs()``, ``get_job(id)``) is as good as the one ``launch`` returned
(:mod:`workbench.runs.launching` starts runs and returns Jobs; :mod:`workbench.runs.attempts`
hands a run to its backend, at launch and on resume).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from workbench.errors import JobFailedError, RunBusyError, WorkbenchError
from workbench.runs.attempts import live_processes, resume_attempt
from workbench.runs.readable import Readable
from workbench.runs.registry import Registry, RunRecord
from workbench.runs.rundir import PENDING, QUEUED, TERMINAL, MetricsReader, RunDir
from workbench.spec import RunSpec
from workbench.targets.backends import Backend, get_backend

# How long wait() gives a supervisor that has recorded its outcome to write the bundle and the
# final bill. A supervisor killed in between never marks ``released``: wait() does not hang on it.
RELEASE_WAIT_S = 60.0
_WRITE_POLL_S = 0.05  # how often Job.wait looks whether status.json was rewritten


def get_job(id_or_name: str, registry: Registry | None = None) -> Job:
    """Find a run again (by id, name, or unique id prefix), e.g. after a kernel restart."""
    registry = registry or Registry()
    return Job(registry.get_run(id_or_name), registry=registry)


def jobs(limit: int | None = None, registry: Registry | None = None) -> list[Job]:
    """Every run in the registry, newest first, with states refreshed from their run dirs."""
    registry = registry or Registry()
    out = [Job(r, registry=registry) for r in registry.list_runs(limit)]
    for job in out:
        if job.record.state not in TERMINAL:
            job.status()
    return out


class Job:
    """A handle on one run: state, metrics, logs, wait, cancel — the same on every backend."""

    def __init__(self, record: RunRecord, registry: Registry | None = None,
                 backend: Backend | None = None) -> None:
        self.record = record
        self.registry = registry or Registry()
        self.backend = backend or get_backend(record.target)
        self.run_dir = RunDir(record.run_dir)
        self._reader = MetricsReader(self.run_dir.metrics_file)
        self._metrics: list[dict[str, Any]] = []

    id = property(lambda self: self.record.id)
    name = property(lambda self: self.record.name)
    target = property(lambda self: self.record.target)

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.state}>"

    # -- state -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """status.json as the backend sees it; keeps the registry's cached state in step."""
        status = self.backend.status(self.run_dir.path, self.record.backend_job_id)
        state = status.get("state", PENDING)
        if state != self.record.state:
            self.registry.update_run(self.id, state=state)
            self.record = self.registry.get_run(self.id)
        return status

    @property
    def state(self) -> str:
        return str(self.status().get("state", PENDING))

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def spec(self) -> RunSpec:
        return self.run_dir.spec()

    # -- metrics and logs ------------------------------------------------------------------------
    def metrics(self) -> list[dict[str, Any]]:
        """Every metrics line so far (read incrementally: each call reads only new bytes).

        After a resume from step N, what the earlier attempt logged past N is dropped, so the
        curve is the one the run actually followed.
        """
        sync = getattr(self.backend, "sync", None)
        if sync is not None:  # remote backends first bring new bytes into the local run dir
            sync(self.run_dir.path)
        for record in self._reader.read_new():
            if record.get("event") == "resume":
                self._metrics = [m for m in self._metrics if m.get("step", 0) <= record["step"]]
                continue
            self._metrics.append(record)
        return list(self._metrics)

    def metrics_df(self) -> Any:
        """The loss table: one row per training log line (step, loss, lr, grad_norm, ...).

        Validation losses are a column, ``eval_loss``, on the row of the step they were
        measured at (NaN between evaluations); an evaluation at a step with no training line
        (``train.log_every`` > 1) is only in :meth:`eval_df`. Snapshot and other event lines
        are not rows. Every row has a loss.
        """
        import pandas as pd

        rows = self.metrics()
        train = pd.DataFrame([m for m in rows if "loss" in m and "event" not in m])
        if train.empty:
            return pd.DataFrame(columns=["step", "loss", "eval_loss"])
        evals = self.eval_df()
        if evals.empty:
            train["eval_loss"] = float("nan")
            return train
        # The last evaluation of a step wins (a resumed run may have measured one step twice).
        at_step = evals.drop_duplicates("step", keep="last")[["step", "eval_loss"]]
        return train.merge(at_step, on="step", how="left")

    def eval_df(self) -> Any:
        """Every validation measurement: step, eval_loss, eval_runtime, ... (one row each)."""
        import pandas as pd

        rows = [m for m in self.metrics() if "eval_loss" in m and "event" not in m]
        return pd.DataFrame(rows, columns=None if rows else ["step", "eval_loss"])

    def logs(self, tail: int | None = 50, name: str | None = None) -> str:
        """The last ``tail`` lines of each log (or of the one called ``name``, e.g. 'rank-0.log')."""
        texts = self.backend.logs(self.run_dir.path)
        if name is not None:
            texts = {name: texts.get(name, "")}
        parts = []
        for fname, text in texts.items():
            lines = text.splitlines()
            if tail is not None:
                lines = lines[-tail:]
            parts.append(f"==> {fname} <==\n" + "\n".join(lines))
        return "\n\n".join(parts)

    # -- control ---------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, progress: bool = True,
             raise_on_failure: bool = False, poll: float = 0.5) -> str:
        """Block until the run ends (or ``timeout`` seconds pass); return the state."""
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.time() + timeout
        bar = None
        try:
            while True:
                status = self.status()
                state = status.get("state", PENDING)
                if progress:
                    total = status.get("total_steps")
                    if bar is None and total:
                        bar = tqdm(total=total, desc=self.name, unit="step")
                    if bar is not None:
                        bar.n = status.get("step", 0) or 0
                        loss = status.get("last_loss")
                        bar.set_postfix_str(f"loss {loss:.3f}" if loss is not None else state,
                                            refresh=True)
                if state in TERMINAL:
                    break
                if deadline is not None and time.time() > deadline:
                    return state
                self._sleep_until_written(poll)
        finally:
            if bar is not None:
                bar.close()
        # The supervisor records the outcome first, then writes reproduce.zip and the final bill
        # and marks the resources ``released``: what a caller reads next is then complete.
        settle = time.time() + RELEASE_WAIT_S
        if deadline is not None:
            settle = min(settle, deadline)
        while "exit_code" in status and "released" not in status and time.time() < settle:
            self._sleep_until_written(poll)
            status = self.status()
        if raise_on_failure and state != "succeeded":
            raise JobFailedError(f"run {self.id} ended {state}: "
                                 f"{status.get('error') or status.get('note') or ''}")
        return state

    def _sleep_until_written(self, poll: float) -> None:
        """Sleep ``poll`` seconds, or less once status.json is rewritten: the end of a run is
        noticed within ~50 ms of its write, not up to a whole poll later (the backend's own
        look, which may ask whether processes live, stays at one per poll)."""
        def stamp() -> tuple[int, int] | None:
            try:
                st = self.run_dir.status_file.stat()
            except OSError:
                return None
            return st.st_ino, st.st_mtime_ns  # written atomically: a new inode each time

        before, until = stamp(), time.time() + poll
        while time.time() < until:
            time.sleep(min(_WRITE_POLL_S, max(0.0, until - time.time())))
            if stamp() != before:
                return

    def resume(self, **changes: Any) -> Job:
        """Start the run again from its newest verified snapshot (local, else from storage).

        A run with no snapshot starts again at step 0, and its status note says so (its curve
        then shows the new attempt only).

        ``changes`` may raise the budget or extend training, e.g.
        ``job.resume(**{"budget.limit": 20})``; they are recorded in resume.yaml (spec.yaml is
        written once). Resuming a run any of whose processes is alive is refused
        (:class:`RunBusyError`), and so is a second resume while one is starting: an exclusive
        lock in the run directory is held from the check to the new supervisor's record, so two
        supervisors never train in one run directory.
        """
        self.status()  # lets the backend record how an attempt whose processes are gone ended
        with self.run_dir.attempt_lock() as free:
            if not free:
                raise RunBusyError(f"run {self.id} is being resumed by another caller right now; "
                                   "follow it with job.status() or job.wait() instead")
            self.run_dir.forget_cancel()  # a cancel asked for from here on stops this resume
            live = live_processes(self.run_dir, grace_s=15.0)
            if live:
                raise RunBusyError(
                    f"run {self.id} still has live processes ("
                    + ", ".join(p.describe() for p in live)
                    + "); wait for them to end or call job.cancel(), then resume")
            job_id = resume_attempt(self, changes,
                                    status_of=lambda run_id: get_job(run_id).status())
            self.registry.update_run(self.id, backend_job_id=job_id or self.record.backend_job_id,
                                     state=self.run_dir.status().get("state", QUEUED))
            self.record = self.registry.get_run(self.id)
            return self

    def cancel(self, timeout: float = 30.0, stop_request: str | None = None) -> str:
        """Stop every process of the run; the run ends 'cancelled' (unless it already ended).

        The request is final: a run still being prepared ends at once and is never submitted,
        and a launch or resume handing the run to its target stops what it started (this call
        waits up to ``timeout`` for that hand-over to end). ``stop_request="prune"`` (a sweep
        stopping a clearly worse trial) ends it 'pruned'."""
        ended_before = self.run_dir.status().get("state", PENDING) in TERMINAL
        self.run_dir.request_cancel(stop_request)
        if not ended_before:
            with self.run_dir.attempt_lock(wait_s=timeout) as free:
                pass  # free: no hand-over is under way, so what runs is in the status
            if not free or self.done:
                return self.state
        # What runs stops; an ended run's processes may still linger (a Slurm job's wrapper).
        self.backend.cancel(self.run_dir.path, self.record.backend_job_id,
                            timeout=timeout, stop_request=stop_request)
        return self.state

    def deploy(self, *more: Any, **kwargs: Any) -> Any:
        """Serve this run on a vLLM endpoint (see :func:`workbench.serve.deploy`); an Endpoint.

        It is served on the target it trained on unless ``target=`` says otherwise.
        """
        from workbench.serve import deploy

        kwargs.setdefault("target", self.target)
        return deploy(self, *more, **kwargs)

    def evaluate(self, tasks: Any = None, *, endpoint: str | None = None, **knobs: Any) -> Any:
        """Score this ended run's weights (or, with ``endpoint=``, a served model) on ``tasks``
        (default: the spec's eval tasks); the scores join the run's eval.jsonl as ``manual``.
        See :func:`workbench.evaluate.remote.evaluate_job`."""
        from workbench.evaluate.remote import evaluate_job

        return evaluate_job(self, tasks, endpoint=endpoint, **knobs)

    def export(self, formats: Any = ("merged",), **kwargs: Any) -> Any:
        """Merged weights, GGUF and an Ollama Modelfile, each with a model card and checked by
        running it (see :func:`workbench.serve.export_run.export`); an ExportReport."""
        from workbench.serve.export_run import export

        return export(self, formats, **kwargs)

    # -- views -----------------------------------------------------------------------------------
    def show(self) -> Any:
        """A live widget: loss curve, throughput, progress, ETA, state and a cancel button."""
        from workbench.widgets.job_view import JobView

        return JobView(self)

    def plot(self, ax: Any = None) -> Any:
        """Train and eval loss against step: a Figure that shows as a PNG in a notebook.

        ``job.plot().savefig("loss.png")`` keeps it; ``ax=`` draws onto your own axes.
        """
        from workbench.widgets.plots import loss_figure

        return loss_figure(self.metrics(), title=self.id, ax=ax)

    def summary(self) -> Readable:
        """One flat dict of what a person asks first: state, progress, loss, speed, time (shown
        rounded and in units in a notebook; the values themselves are exact)."""
        status = self.status()
        rows = self.metrics()
        train = [m for m in rows if "loss" in m]
        evals = [m for m in rows if "eval_loss" in m]
        speeds = [m["tokens_per_s"] for m in train if m.get("tokens_per_s")]
        planned = self.planned()
        if "price_per_hour" not in planned:  # no plan.json: the supervisor's price (0 if unknown)
            planned["price_per_hour"] = status.get("price_per_hour")
        return Readable({
            "id": self.id, "state": status.get("state"), "target": self.target,
            "queue_reason": status.get("queue_reason"),  # why a queued Slurm job waits
            "step": status.get("step"), "total_steps": status.get("total_steps"),
            "first_loss": train[0]["loss"] if train else None,
            "last_loss": train[-1]["loss"] if train else None,
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
            "elapsed_s": status.get("elapsed_s"), "eta_s": status.get("eta_s"),
            "budget_warning": status.get("budget_warning"),  # projected cost past the limit
            # The live projection at the measured pace (callbacks.project) against the plan.
            **{k: status.get(k) for k in ("projected_total_s", "projected_total_range_s",
                                          "projected_cost", "projected_cost_range")},
            **planned,
            "cost": status.get("cost"), "currency": status.get("currency") or planned["currency"],
            "snapshot": (status.get("snapshot") or {}).get("path"),
            "upload": (status.get("upload") or {}).get("state"),
            "snapshot_error": _snapshot_error(status.get("snapshot_error")),
            "restarts": status.get("restarts"),
            "error": status.get("error"),
            "note": status.get("note"),  # why a run stopped short, and how to go on (budget)
            "phase": _phase(status),  # e.g. "preparing train 40000/200000" during launch
        })

    def planned(self) -> dict[str, Any]:
        """plan.json's total seconds and cost (None without a plan or before plans had a clock),
        and its price per billed unit-hour (None: no price known, 0: free), by which every view
        writes the run's money (:mod:`workbench.runs.money`)."""
        import json

        try:
            plan = json.loads(self.run_dir.plan_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            plan = {}
        out = {"planned_total_s": (plan.get("clock") or {}).get("total_s"),
               "planned_cost": plan.get("cost"), "currency": plan.get("currency")}
        if "price_per_hour" in plan:
            out["price_per_hour"] = plan["price_per_hour"]
        return out

    def _repr_html_(self) -> str:
        import html

        s = self.summary()
        cells = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                        for k, v in s.shown_items())
        return f"<table>{cells}</table>"

    def artefact(self) -> Path:
        art = self.run_dir.artefact_dir()
        if art is None:
            raise WorkbenchError(f"run {self.id} has no adapter/ or model/ (state {self.state})")
        return art


def _phase(status: dict[str, Any]) -> str | None:
    if not status.get("phase"):
        return None
    p = status.get("prepare") or {}
    done = f" {p.get('split')} {p.get('done', 0)}/{p.get('total', '?')}" if p.get("split") else ""
    return f"{status['phase']}{done}"


def _snapshot_error(err: dict[str, Any] | None) -> str | None:
    """status.json's ``snapshot_error`` in one line: which snapshot failed, where, and why."""
    if not err:
        return None
    return f"step {err.get('step')} ({err.get('stage')}): {err.get('error')}"
