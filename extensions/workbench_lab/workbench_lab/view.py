"""What the Runs panel shows, computed from the workbench library (never a second implementation).

Every row, detail view and action goes through ``workbench.jobs()``, ``Job.summary()``,
``Job.metrics()``, ``Job.logs()`` and ``Job.cancel()``. Features that other parts of the library
provide only in some versions (resume, snapshots, deploy, endpoints) are detected here, and the
answer travels to the panel as ``capabilities`` so it never shows a button that cannot work.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import threading
from pathlib import Path
from typing import Any

import workbench
from workbench.errors import RunNotFoundError, WorkbenchError
from workbench.runs.jobs import Job
from workbench.runs.money import summary_money
from workbench_lab import exporting
from workbench_lab.describe import comparison, distinguish, downsample, scores, settings

RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
_RUN_ID = re.compile(RUN_ID_PATTERN + r"\Z")
_LOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
_TARGET = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,199}\Z")  # local, ssh:NAME, slurm:NAME
CURVE_POINTS = 60  # points of a row's mini loss curve: enough for a shape, small on the wire
PLOT_POINTS = 600  # points of the full loss plot in the details view


class InvalidRequestError(WorkbenchError, ValueError):
    """A run id, log name or folder in a request is malformed (400)."""


class UnsupportedError(WorkbenchError, NotImplementedError):
    """The installed workbench library does not provide this action (501)."""


def _serve_module() -> Any | None:
    try:
        return importlib.import_module("workbench.serve")
    except ImportError:
        return None


def _snapshots_module() -> Any | None:
    try:
        return importlib.import_module("workbench.runs.snapshots")
    except ImportError:
        return None


def capabilities() -> dict[str, bool]:
    """Which actions the installed library supports; the panel shows only these."""
    serve = _serve_module()
    return {
        "cancel": True,
        "resume": callable(getattr(Job, "resume", None)),
        "snapshots": callable(getattr(_snapshots_module(), "snapshots", None)),
        "deploy": callable(getattr(Job, "deploy", None)) or callable(getattr(serve, "deploy", None)),
        "endpoints": callable(getattr(serve, "endpoints", None)),
        "stop_endpoint": callable(getattr(serve, "undeploy", None)),
        "tensorboard": importlib.util.find_spec("tensorboard") is not None,
        "export": importlib.util.find_spec("workbench.serve.export_run") is not None,
    }


def _check_run_id(run_id: str) -> None:
    if not _RUN_ID.match(run_id):
        raise InvalidRequestError(f"{run_id!r} is not a run id (letters, digits, '.', '_', '-')")


class RunsView:
    """Shapes runs for the panel. Keeps one Job per run so metrics are read incrementally."""

    def __init__(self, root_dir: str | Path) -> None:
        self.root_dir = Path(root_dir).resolve()
        self._jobs: dict[str, Job] = {}
        # Handlers call in from a thread pool; a Job's incremental metrics reader is not re-entrant.
        self._lock = threading.RLock()

    # -- lookup ---------------------------------------------------------------------------------
    def job(self, run_id: str) -> Job:
        """The run with exactly this id (names and prefixes are for people, not for URLs)."""
        _check_run_id(run_id)
        with self._lock:
            if run_id not in self._jobs:
                job = workbench.get_job(run_id)
                if job.id != run_id:
                    raise RunNotFoundError(f"no run with id {run_id!r}; the panel lists the runs")
                self._jobs[run_id] = job
            return self._jobs[run_id]

    def browse_path(self, job: Job) -> str | None:
        """The run folder relative to the file browser's root, or None when it lies outside."""
        return self.browse_path_of(job.run_dir.path)

    def browse_path_of(self, folder: str | Path) -> str | None:
        try:
            return Path(folder).resolve().relative_to(self.root_dir).as_posix()
        except ValueError:
            return None

    # -- views ----------------------------------------------------------------------------------
    def row(self, job: Job) -> dict[str, Any]:
        summary = job.summary()
        status = job.run_dir.status()
        losses = [[m["step"], m["loss"]] for m in job.metrics() if "loss" in m and "step" in m]
        return {
            **summary,
            "name": job.name,
            "created": job.record.created,
            "cost": summary.get("cost", status.get("cost")),
            "currency": summary.get("currency") or status.get("currency"),
            # The money as text, written by the library's one rule (workbench.runs.money): the
            # panel shows these strings, so a free run reads "free" here as in the notebook.
            "money": summary_money(summary) if "price_per_hour" in summary else {},
            "curve": downsample(losses, CURVE_POINTS),
            "browse_path": self.browse_path(job),
            "has_tensorboard": job.run_dir.tb_dir.is_dir(),
        }

    def runs(self) -> dict[str, Any]:
        rows = []
        with self._lock:
            for fresh in workbench.jobs():
                job = self._jobs.setdefault(fresh.id, fresh)
                rows.append(self.row(job))
        groups, trial_of = self.sweeps()
        for row in rows:
            tag = trial_of.get(row["id"]) or _sweep_tag(self._jobs[row["id"]])
            row["sweep"] = tag
        distinguish(rows, [self._jobs[r["id"]] for r in rows])
        return {"capabilities": capabilities(), "runs": rows, "endpoints": self.endpoints(),
                "targets": self.targets(), "sweeps": groups, "wallet": wallet()}

    def sweeps(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """One row per sweep (newest first), for the panel to group its trials under, and which
        sweep and trial each run is ({run id: {"sweep", "trial"}}), read from the sweeps' own
        records: the ``{sweep, trial}`` tag in a run's status.json is written on this machine,
        and a remote run's status.json is a mirror of the target's copy."""
        module = importlib.import_module("workbench")
        listing = getattr(module, "sweeps", None)
        if not callable(listing):
            return [], {}
        groups, trial_of = [], {}
        for sweep in listing():
            try:
                data = sweep.data()
            except (OSError, ValueError):  # a sweep being created: it shows on the next refresh
                continue
            trials = [t for t in data.get("trials", []) if not t.get("abandoned")]
            for t in trials:
                if t.get("run_id"):
                    trial_of[t["run_id"]] = {"sweep": sweep.id, "trial": t["number"]}
            try:
                best: dict[str, Any] | None = {k: v for k, v in sweep.best.items() if k != "job"}
            except WorkbenchError:
                best = None  # no trial has a value yet
            groups.append({
                "id": sweep.id, "name": data.get("name"), "state": data.get("state"),
                "objective": data.get("objective"), "direction": data.get("direction"),
                "trials_total": data.get("trials_total"),
                "trials_done": sum(1 for t in trials if t.get("released") and t.get("run_id")),
                "spent": sweep.spent, "held": getattr(sweep, "held", None),
                "budget": data.get("budget"),
                "currency": data.get("currency"), "best": best,
                "runs": [t["run_id"] for t in sorted(trials, key=lambda t: t["number"])
                         if t.get("run_id")],
                "error": data.get("error") or data.get("note"),
            })
        return groups, trial_of

    def targets(self) -> list[str]:
        """Where runs can go (and be served): ``local`` first, then the configured targets."""
        names = getattr(importlib.import_module("workbench.targets.named"), "target_names", None)
        return list(names()) if callable(names) else ["local"]

    def details(self, run_id: str, tail: int = 100) -> dict[str, Any]:
        with self._lock:
            job = self.job(run_id)
            metrics = job.metrics()
            row = self.row(job)
        points = [{k: m[k] for k in ("step", "loss", "eval_loss") if k in m}
                  for m in metrics if "step" in m and ("loss" in m or "eval_loss" in m)]
        details = {
            **row,
            "run_dir": str(job.run_dir.path),
            "metrics": downsample(points, PLOT_POINTS),
            "log_names": [p.name for p in job.run_dir.log_files()],
            "logs": job.logs(tail=tail),
            "snapshots": None,
            "scores": scores(job),
            "export": exporting.state(job),
            **settings(job),
        }
        if capabilities()["snapshots"]:
            details["snapshots"] = self.snapshots(job)
        return details

    def snapshots(self, job: Job) -> list[dict[str, Any]]:
        """The run's step-N snapshots, newest first, as ``workbench.runs.snapshots`` lists them.

        "complete" means the manifest was written (the library's rule for a snapshot that counts);
        checksums are not re-verified here, since that reads every byte of every snapshot.
        """
        module = _snapshots_module()
        manifest = getattr(module, "MANIFEST", "manifest.json")
        latest_file = job.run_dir.path / "checkpoints" / "latest"
        latest = latest_file.read_text().strip() if latest_file.is_file() else None
        return [{"name": folder.name, "complete": (folder / manifest).is_file(),
                 "latest": folder.name == latest, "browse_path": self.browse_path_of(folder)}
                for folder in module.snapshots(job.run_dir)]  # type: ignore[union-attr]

    def compare(self, run_ids: list[str]) -> dict[str, Any]:
        """Two or more runs side by side (:func:`workbench_lab.describe.comparison`)."""
        if len(set(run_ids)) < 2:
            raise InvalidRequestError("compare needs two different run ids (?runs=ID,ID)")
        jobs = [self.job(r) for r in dict.fromkeys(run_ids)]
        return comparison(jobs)

    def logs(self, run_id: str, name: str | None, tail: int) -> str:
        if name is not None and not _LOG_NAME.match(name):
            raise InvalidRequestError(f"{name!r} is not a log file name (e.g. rank-0.log)")
        job = self.job(run_id)
        if name is not None and name not in {p.name for p in job.run_dir.log_files()}:
            raise InvalidRequestError(f"run {run_id} has no log {name!r}")
        return job.logs(tail=tail, name=name)

    # -- actions --------------------------------------------------------------------------------
    def cancel(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            job = self.job(run_id)
        job.cancel()  # waits for the processes to stop: not under the lock
        with self._lock:
            return self.row(job)

    def resume(self, run_id: str, budget_limit: Any = None) -> dict[str, Any]:
        """Restart an ended run; ``budget_limit``: a larger limit (after a budget stop)."""
        if not capabilities()["resume"]:
            raise UnsupportedError("this workbench version cannot resume runs")
        changes = {}
        if budget_limit is not None:
            if isinstance(budget_limit, bool) or not isinstance(budget_limit, (int, float)) or (
                    budget_limit <= 0):
                raise InvalidRequestError(f"budget_limit must be a positive number, not "
                                          f"{budget_limit!r}")
            changes["budget.limit"] = float(budget_limit)
        job = self.job(run_id)
        resumed = job.resume(**changes)  # type: ignore[attr-defined]
        if isinstance(resumed, Job):
            self._jobs[resumed.id] = resumed
            job = resumed
        return self.row(job)

    def deploy(self, run_id: str, target: str | None = None) -> dict[str, Any]:
        """Start serving the run and return at once: the endpoint shows up as 'starting'.

        ``target``: where to serve (``local``, ``ssh:NAME``, ``slurm:NAME``); by default where
        the run trained. The server outlives this request (``keep=True``); the panel lists it
        under Endpoints.
        """
        if not capabilities()["deploy"]:
            raise UnsupportedError("this workbench version cannot deploy runs (no workbench.serve)")
        if target is not None and not (isinstance(target, str) and _TARGET.match(target)):
            raise InvalidRequestError(f"{target!r} is not a target name (e.g. local, ssh:NAME)")
        job = self.job(run_id)
        deploy = getattr(job, "deploy", None)
        if not callable(deploy):
            deploy = functools.partial(_serve_module().deploy, job)  # type: ignore[union-attr]
        wanted: dict[str, Any] = {"keep": True, "wait": False, "progress": False}
        if target is not None:
            wanted["target"] = target
        accepted = inspect.signature(deploy).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            if target is not None and "target" not in accepted:
                raise UnsupportedError("this workbench version serves only where the run trained")
            wanted = {k: v for k, v in wanted.items() if k in accepted}
        endpoint = deploy(**wanted)
        return {"endpoint": _endpoint_row(endpoint)}

    def export(self, run_id: str, options: dict[str, Any]) -> dict[str, Any]:
        """Start exporting the run (:mod:`workbench_lab.exporting`); returns at once."""
        if not capabilities()["export"]:
            raise UnsupportedError("this workbench version cannot export runs")
        return exporting.start(self.job(run_id), options.get("formats"), options.get("quant"))

    def endpoints(self) -> list[dict[str, Any]]:
        serve = _serve_module()
        if not callable(getattr(serve, "endpoints", None)):
            return []
        return [_endpoint_row(e) for e in serve.endpoints()]  # type: ignore[union-attr]

    def stop_endpoint(self, name: str) -> dict[str, Any]:
        serve = _serve_module()
        if not callable(getattr(serve, "undeploy", None)):
            raise UnsupportedError("this workbench version cannot stop endpoints")
        _check_run_id(name)
        return {"name": name, "state": serve.undeploy(name)}  # type: ignore[union-attr]


def _sweep_tag(job: Job) -> dict[str, Any] | None:
    """The ``{"sweep", "trial"}`` tag a sweep's controller wrote into the run's status.json."""
    tag = job.run_dir.status().get("sweep")
    if isinstance(tag, dict) and "id" in tag:
        return {"sweep": tag["id"], "trial": tag.get("trial")}
    return None


def _endpoint_row(endpoint: Any) -> dict[str, Any]:
    """An endpoint as the panel lists it; every field read through the library's Endpoint."""
    record = getattr(endpoint, "record", None)
    row: dict[str, Any] = {
        "name": getattr(endpoint, "name", str(endpoint)),
        "state": getattr(record, "state", None),
        "target": getattr(endpoint, "target", None),
        # Where it listens (its host or Slurm node): listing must not open SSH tunnels.
        "url": getattr(endpoint, "listen_url", None) and f"{endpoint.listen_url}/v1",
    }
    try:
        row["models"] = list(endpoint.models)
    except (AttributeError, KeyError, TypeError):
        row["models"] = []
    note = getattr(endpoint, "money_note", None)
    row["money"] = note() if callable(note) else None  # what the wallet covers, why it stopped
    return row


def wallet() -> dict[str, Any] | None:
    """The wallet of this WORKBENCH_HOME for the panel's header (ended work settled first):
    balance, held and by what, spent; None without a wallet (or a workbench without wallets)."""
    try:
        from workbench.runs.credit import Credit, run_status
    except ImportError:
        return None
    found = Credit.open(status_of=run_status)
    if found is None:
        return None
    found.settle_ended()
    data = found.to_dict()
    data["history"] = data["history"][-20:]  # the newest lines; `workbench credit history`: all
    return data
