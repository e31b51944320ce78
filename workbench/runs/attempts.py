"""An attempt of a run: handing the run to its backend (at launch and on each resume), and the
checks and the wallet hold a resume goes through before its attempt starts.

An attempt is one life of a run's processes; a resumed run has several. The run's attempt lock
(:meth:`~workbench.runs.rundir.RunDir.attempt_lock`) is held around each hand-over, so a cancel
asked meanwhile is carried out once the backend knows what it started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workbench.errors import BudgetError, RunBusyError, WorkbenchError
from workbench.runs import procs
from workbench.runs.rundir import BUDGET_STOPPED, CANCEL_REQUESTED, FAILED, QUEUED, TERMINAL, RunDir
from workbench.spec import RunSpec
from workbench.targets.backends import Backend

if TYPE_CHECKING:
    from workbench.runs.jobs import Job

# What a resume may change; everything else of the spec is the run's for good.
RESUME_CHANGES = {"budget.limit", "train.max_steps", "train.epochs", "checkpoint.storage"}


def submit_attempt(backend: Backend, rd: RunDir, spec: RunSpec, claim: dict[str, Any],
                   **options: Any) -> str | None:
    """Hand the run to ``backend`` (``claim``: the status of a run being submitted) unless a
    cancel was asked for; None then, with nothing started. The caller holds the run's attempt
    lock, so a cancel asked meanwhile waits for this to return; one asked while the backend
    started the run is carried out here, once the backend knows what it started."""
    if not rd.start_unless_cancelled(**claim):
        return None
    try:
        job_id = backend.submit(rd.path, spec, **options)
    except BaseException as exc:  # refused: the run ends failed, not queued for ever
        why = str(exc) or type(exc).__name__
        rd.update_status(lambda s: None if s.get("state") in TERMINAL else s.update(
            state=FAILED, ended=time.time(), error=why))
        raise
    if rd.status().get(CANCEL_REQUESTED) is not None:
        backend.cancel(rd.path, job_id)
    return job_id


def live_processes(rd: RunDir, grace_s: float) -> list[procs.ProcessIdentity]:
    """The current attempt's live processes on this host. After a recorded outcome they get
    ``grace_s`` to exit: the supervisor writes the outcome just before it exits."""
    deadline = time.time() + grace_s
    while True:
        status = rd.status()
        live = procs.alive_here(p for p in procs.of_attempt(status) if p.here)
        if not live or status.get("state") not in TERMINAL or time.time() > deadline:
            return live
        time.sleep(0.2)


def resume_attempt(job: Job, changes: dict[str, Any],
                   status_of: Callable[[str], dict[str, Any]]) -> str | None:
    """Start a new attempt of ``job``'s ended run with ``changes`` (recorded in resume.yaml) and
    return the backend's id for it (None: a cancel came first). The caller holds the attempt
    lock. Refused, with nothing written, for a change a resume may not make, a run that has not
    ended, or a budget that would stop it again at once; with a wallet, the resume holds what it
    may add (``status_of`` reads another run's status for the wallet)."""
    bad = set(changes) - RESUME_CHANGES
    if bad:
        raise WorkbenchError(f"cannot change {sorted(bad)} on resume; allowed: "
                             f"{sorted(RESUME_CHANGES)}")
    state = job.state
    if state not in TERMINAL:
        raise RunBusyError(f"run {job.id} is {state}; cancel it first or wait for it")
    status = job.status()
    spent = status.get("cost") or 0.0
    limit = changes.get("budget.limit")
    import yaml

    from workbench.runs.budget import check_enforceable
    from workbench.runs.wallet import Wallet

    earlier: dict[str, Any] = {}
    if job.run_dir.resume_file.is_file():
        earlier = yaml.safe_load(job.run_dir.resume_file.read_text()) or {}
    merged = {**earlier, **changes}
    resumed = RunSpec.from_yaml(job.run_dir.spec_file).updated(**merged)
    wallet, hold_id = Wallet.open(status_of=status_of), None
    if wallet is not None:  # the resume holds what it may add, and is limited to it
        from workbench.plan import plan

        resumed, hold_id = wallet.hold_resume(job.run_dir, resumed, spent, limit,
                                              plan(resumed).cost, f"resume of {job.id}")
        if hold_id is not None:
            merged["budget.limit"] = limit = resumed.budget.limit
    try:
        if state == BUDGET_STOPPED and (not isinstance(limit, (int, float)) or limit <= spent):
            raise BudgetError(
                f"run {job.id} stopped at its budget: {spent:.4g} "
                f"{status.get('currency', '')} spent of {job.spec.budget.limit or 0:g}; "
                "resuming with " + ("no new limit" if limit is None
                                    else f"a budget.limit of {limit:g}")
                + " would stop it again at once. Give a larger one: "
                f"job.resume(**{{'budget.limit': N}}) or `workbench resume {job.id} "
                "--budget N`")
        # Validated (and the budget checked against what is spent) before anything is written.
        check_enforceable(resumed, spent)
        if merged != earlier:
            job.run_dir.resume_file.write_text(yaml.safe_dump(merged), encoding="utf-8")
        if hold_id is not None:
            wallet.attach(hold_id, "resume", job.id, str(job.run_dir.path),  # type: ignore[union-attr]
                          base_cost=spent)
        job_id = submit_attempt(job.backend, job.run_dir, job.run_dir.spec(), {
            "state": QUEUED, "error": None, "stop_reason": None, "stop_request": None,
            "note": None, "ended": None})
    except BaseException:
        if hold_id is not None:
            wallet.release(hold_id, 0, f"resume of {job.id} refused")  # type: ignore[union-attr]
        raise
    return job_id
