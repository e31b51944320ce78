"""launch(): the one launch path every front end (widgets, magics, CLI, panel) calls.

    >>> job = launch(RunSpec(train={"max_steps": 20}))   # doctest: +SKIP
    >>> job.wait()                                       # doctest: +SKIP
    'succeeded'

``launch`` validates the spec, checks the model and the resources, prepares the data into a new
run directory, records the run in the registry and hands it to the target's backend; it returns
the run's :class:`~workbench.runs.jobs.Job`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import DatasetError, DataTruncationWarning, LaunchError
from workbench.runs.attempts import submit_attempt
from workbench.runs.home import runs_dir
from workbench.runs.jobs import Job, get_job
from workbench.runs.registry import Registry, RunRecord
from workbench.runs.rundir import CANCEL_REQUESTED, PENDING, QUEUED, RunDir, write_json_atomic
from workbench.spec import RunSpec
from workbench.targets.backends import Backend, get_backend

if TYPE_CHECKING:
    from workbench.targets.remote_model import TargetModel

KERNEL_TARGET_ENV = "WORKBENCH_TARGET"  # set by the remote-kernel provisioner on the target


def _new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _validate_model(spec: RunSpec) -> None:
    from workbench.plan.shape import local_config_fields

    m = spec.model
    # A local config.json of a family the planner counts has been read and understood already;
    # only the rest needs transformers (a hub download, remote code, another model_type).
    if local_config_fields(m.id, m.trust_remote_code) is not None:
        return
    from workbench.spec.models import load_config

    load_config(m.id, m.revision, m.trust_remote_code)


def _model_on_target(spec: RunSpec, backend: Any) -> TargetModel | None:
    """The model folder as the target sees it, when it is not on this machine; None: the model
    is checked here (a built-in, a hub id, or a folder that exists here)."""
    from workbench.targets.remote_model import check_on_target, lives_on_target

    return check_on_target(spec, backend) if lives_on_target(spec) else None


def _validate_tracking(spec: RunSpec) -> None:
    import importlib.util

    if spec.tracking.wandb != "disabled" and importlib.util.find_spec("wandb") is None:
        raise LaunchError(
            f"tracking.wandb is {spec.tracking.wandb!r} but wandb is not installed here; "
            "pip install 'workbench[wandb]' or set tracking.wandb: disabled"
        )


def _plan(spec: RunSpec, force: bool, longest: int | None = None) -> dict[str, Any]:
    """The planner's verdict; refuses a plan that cannot fit unless ``force``."""
    from workbench.plan import check_fits, plan

    result = plan(spec, longest=longest)
    if not force:
        check_fits(result)
    return result.to_dict()


def _prepare_data(spec: RunSpec, rd: RunDir, force: bool = False,
                  on_target: TargetModel | None = None) -> None:
    """Read, clean and split the data, then tokenise it once for every rank (see
    workbench.data.tokenized); refuses data that truncation would leave with too little to train.
    A model folder only the target has (``on_target``) leaves tokenising to the ranks."""
    from workbench.data.prepare import prepare_data
    from workbench.data.tokenized import (
        check_trainable,
        files_key,
        prepare_tokenized,
        reuse_tokenized,
        truncation_notice,
    )

    if spec.method.stage != "sft":  # preference/prompt rows: checked here, tokenised by TRL
        from workbench.data.preference import prepare_preference_data

        rd.write_status(data=prepare_preference_data(spec, rd.data_dir).counts)
        return
    from workbench.spec.models import is_vision_model

    # A folder only the target has is not read here (its tokenizer is there too).
    if on_target is None and is_vision_model(spec.model.id, spec.model.revision,
                                             spec.model.trust_remote_code):
        from workbench.data.vision import prepare_vision_data  # the ranks batch with the processor

        rd.write_status(data=prepare_vision_data(spec, rd.data_dir).counts)
        return
    if on_target is None and (spec.data.image_min_pixels or spec.data.image_max_pixels):
        raise DatasetError(f"data.image_min_pixels / image_max_pixels size the images of a model "
                           f"that reads them, and {spec.model.id} reads text only; remove them")
    key = files_key(spec)  # before reading the sources, as prepare_data's own key is
    summary = prepare_data(spec, rd.data_dir, cache=True)
    if rd.write_status(data=summary.counts).get(CANCEL_REQUESTED) is not None:
        return  # cancelled while the data was read: the launch submits nothing, so no tokens
    if on_target is not None:  # its tokenizer is there: the ranks tokenise
        rd.write_status(prepare={"skipped": f"model folder {on_target.path} is on "
                                            f"{on_target.where}, not here: the ranks tokenise"})
        return
    # Tokenised before from the same files: linked without loading the tokenizer (transformers).
    stats = reuse_tokenized(spec, rd, key)
    if stats is None:
        from workbench.data.tokenize import load_tokenizer
        from workbench.spec.models import resolve_model

        try:
            tokenizer = load_tokenizer(spec, resolve_model(spec.model.id))
        except (OSError, ValueError) as exc:  # the tokenizer is only on the target: ranks do it
            rd.write_status(prepare={"skipped": f"tokenizer not loadable here: {exc}"})
            return
        stats = prepare_tokenized(spec, rd, tokenizer, key=key)
    check_trainable(stats, spec)  # the cached statistics are checked exactly as fresh ones
    notice = truncation_notice(stats, spec)
    if notice:  # said where the user looks (stderr: the notebook cell, the terminal, the form)
        rd.write_status(notices=[notice])
        warnings.warn(notice, DataTruncationWarning, stacklevel=4)
    # The plan measured a sample; what the run will train on is now known exactly.
    plan = json.loads(rd.plan_file.read_text(encoding="utf-8"))
    longest = (stats.splits["train"].summarised().tokens or {}).get("max")
    if longest and plan.get("memory_seq_len") and min(longest, spec.data.max_length) > \
            plan["memory_seq_len"]:
        # The sample missed longer rows: their batches need more activation memory than planned.
        plan = _plan(spec, force, longest=longest)
    write_json_atomic(rd.plan_file, {**plan, "data_tokens": {**stats.to_dict(), "sampled": False}})


# How long a launch waits for the run's attempt lock, which a cancel or a status check of the
# new run holds only for a moment.
HAND_OVER_WAIT_S = 60.0

# Launches from threads of one process (a notebook's executor, two widgets at once) take turns:
# transformers' lazy imports are not thread-safe (two first imports at once raised ImportError
# in one of them). Launches from other processes only race for the run id, which create() claims.
_TURN = threading.Lock()


def launch(spec: RunSpec | dict | str | Path | None = None, *, force: bool = False,
           registry: Registry | None = None) -> Job:
    """Start a run and return its Job. ``spec`` may be a RunSpec, a mapping, or a YAML path.

    Nothing is left behind when a check fails: the run directory is only kept (and the run only
    registered) once the spec, model, resources, plan and data have all been accepted.
    """
    if os.environ.get("WORKBENCH_COURSE_URL") and registry is None:  # a course hub's kernel:
        from workbench.course.client import launch_via_course  # its service holds and launches

        return launch_via_course(spec, force=force)  # type: ignore[return-value]
    with _TURN:
        return _launch(spec, force, registry)


def _launch(spec: RunSpec | dict | str | Path | None, force: bool,
            registry: Registry | None) -> Job:
    spec = RunSpec.coerce(spec)
    if "target" not in spec.model_fields_set and os.environ.get(KERNEL_TARGET_ENV):
        # In a remote kernel (workbench.targets.kernels) a spec that names no target runs where it is.
        spec = spec.updated(target=os.environ[KERNEL_TARGET_ENV])
    registry = registry or Registry()
    backend = get_backend(spec.target)
    if spec.target != "local":  # a named target's defaults fill what the spec left unset
        from workbench.targets.named import apply_defaults, get_target

        spec = apply_defaults(spec, get_target(spec.target))
    from workbench.runs.budget import check_enforceable

    check_enforceable(spec)  # a limit without a price (or in another currency) is no limit
    if spec.checkpoint.storage and spec.target == "local":  # other targets use their own keys
        from workbench.runs.snapshots import check_storage

        check_storage(spec.checkpoint.storage)
    # Cheapest first: the target's resources, then the plan (which knows common configs offline,
    # so a run that cannot fit says so even where the weights are out of reach), then the model.
    if spec.target == "local":
        from workbench.targets.backends.local import check_local_resources

        check_local_resources(spec)
    elif hasattr(backend, "check_resources"):  # e.g. what the nodes of a Slurm partition have
        backend.check_resources(spec)
    _validate_tracking(spec)
    from workbench.plan.probe import LaunchProbe

    probe = LaunchProbe.start(spec)  # an uncalibrated remote target is measured meanwhile
    standby = None
    if spec.target == "local":  # the ranks import their libraries while we plan and prepare
        from workbench.runs.standby import Standby

        standby = Standby.start(spec)
    try:
        rd, spec = _accept(spec, force, registry, backend, probe)
    except BaseException:  # refused: no process of the run may outlive the refusal
        if standby is not None:
            standby.discard()
        raise
    if standby is not None and _wait_spent_the_limit(standby, spec):
        standby.discard()  # the attempt starts afresh: its bill starts with its supervisor
        standby = None
    options = {} if standby is None else {"standby": standby}
    with rd.attempt_lock(wait_s=HAND_OVER_WAIT_S) as free:
        job_id = submit_attempt(backend, rd, spec, {"state": QUEUED}, **options) if free else None
    if job_id is None and standby is not None:  # cancelled while it was prepared: none started
        standby.discard()
    if not free:
        raise LaunchError(f"run {rd.path.name} is being started by another caller; "
                          f"follow it with workbench.get_job({rd.path.name!r})")
    registry.update_run(rd.path.name, backend_job_id=job_id,
                        state=rd.status().get("state", QUEUED))
    return Job(registry.get_run(rd.path.name), registry=registry, backend=backend)


def _wait_spent_the_limit(standby: Any, spec: RunSpec) -> bool:
    """Would the standby's wait (the bill runs from its start: its ranks were importing while
    the launch planned and prepared the data), then a stop and the release, pass the run's
    budget.limit? A first launch on a fresh machine can plan for seconds (the built-in model
    built, the clock measured)."""
    if spec.budget.limit is None:
        return False
    import psutil

    from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, hourly_price

    price, _ = hourly_price(spec)
    try:
        age = time.time() - psutil.Process(standby.proc.pid).create_time()
    except psutil.Error:
        return False
    return (price or 0.0) * (age + KILL_GRACE_S + RELEASE_S) / 3600 > spec.budget.limit


def _accept(spec: RunSpec, force: bool, registry: Registry, backend: Backend,
            probe: Any = None) -> tuple[RunDir, RunSpec]:
    """Plan, check the model, hold the plan's cost in the wallet (if one is set), create the run
    directory and prepare its data: the accepted run's directory, registered, and its spec
    (limited to its hold); nothing is left behind, and nothing held, when any of it is refused."""
    on_target = _model_on_target(spec, backend)
    if (spec.data.packing or spec.method.kind == "qlora") and on_target is None:
        from workbench.data.vision import check_vision_spec
        from workbench.spec.models import is_vision_model

        if is_vision_model(spec.model.id, spec.model.revision, spec.model.trust_remote_code):
            check_vision_spec(spec)  # before planning: the plan would pack the rows
    if on_target is None:
        plan = _plan(spec, force)
        _validate_model(spec)
    else:  # planned from the config.json read there
        from workbench.plan.shape import model_shape
        from workbench.targets.remote_model import planned_from

        model_shape.cache_clear()  # cached by model id: this path may hold another model there
        try:
            with planned_from(on_target):
                plan = _plan(spec, force)
        finally:
            model_shape.cache_clear()
    from workbench.runs.wallet import Wallet

    wallet = Wallet.open(status_of=lambda run_id: get_job(run_id, registry).status())
    hold_id = None
    imposed = spec.budget.limit is None
    if wallet is not None:  # the run is limited to what it holds
        spec, hold_id = wallet.hold_run(spec, plan.get("cost"), f"run {spec.name!r}",
                                        limit=spec.budget.limit,
                                        fixed_cost=plan.get("startup_cost") or 0.0)
        if hold_id is not None:
            plan["budget_limit"] = spec.budget.limit
            plan["wallet_hold"] = wallet.money(wallet.minor(spec.budget.limit or 0.0))
    try:
        return (_create(spec, plan, force, registry, probe, on_target, wallet, hold_id, imposed),
                spec)
    except BaseException:
        if wallet is not None and hold_id is not None:
            wallet.release(hold_id, 0, f"run {spec.name!r} refused before it started")
        raise


def _create(spec: RunSpec, plan: dict[str, Any], force: bool, registry: Registry, probe: Any,
            on_target: Any, wallet: Any, hold_id: int | None, imposed: bool) -> RunDir:
    for _ in range(20):
        run_id = _new_run_id(spec.name)
        rd = RunDir(runs_dir() / run_id)
        try:
            rd.create(spec)
            break
        except FileExistsError:  # a launch of the same name took this id in the same second
            continue
    else:
        raise LaunchError(f"could not find a free run id for {spec.name!r} under {runs_dir()}; "
                          "check that the folder is writable and not full of stale runs")
    if hold_id is not None:
        wallet.attach(hold_id, "launch", run_id, str(rd.path), imposed=imposed)
    now = time.time()
    # Registered before the data step so `workbench status` and the panel show it preparing;
    # removed again (with its run dir) if the data is refused.
    registry.add_run(RunRecord(id=run_id, name=spec.name, target=spec.target, backend_job_id=None,
                               run_dir=str(rd.path), state=PENDING, created=now, updated=now))
    try:
        write_json_atomic(rd.plan_file, plan)
        _prepare_data(spec, rd, force, on_target)
        if probe is not None:  # the plan's clock from the target's measurement, or why not
            probe.settle(rd.plan_file, spec, on_target)
    except BaseException:
        registry.delete_run(run_id)
        shutil.rmtree(rd.path, ignore_errors=True)
        raise
    return rd
