"""Data-parallel strategy of a run: plain DDP, or DeepSpeed ZeRO 1/2/3 with optional CPU offload.

The strategy is resolved once, at launch, by the planner (``parallel.strategy: auto``) and written
to plan.json; every rank reads the same decision from there. DeepSpeed is driven through the
Trainer's ``deepspeed=`` config, so the training code is identical for every strategy.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec
from workbench.spec.precision import Precision, local_device_kind, resolve_precision
from workbench.spec.sections import ParallelSpec


def resolved_parallel(spec: RunSpec, rd: RunDir) -> ParallelSpec:
    """The spec's strategy, or for "auto" the planner's choice recorded in plan.json."""
    if spec.parallel.strategy != "auto":
        return spec.parallel
    try:
        chosen = json.loads(rd.plan_file.read_text())["strategy"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        from workbench.plan import choose_strategy

        return choose_strategy(spec)
    return ParallelSpec(strategy=chosen["parallel"], offload_optimizer=chosen["offload_optimizer"],
                        offload_params=chosen["offload_params"])


def resolved_optimizer(spec: RunSpec, rd: RunDir) -> str:
    """``train.optimizer``, or for "auto" the planner's choice recorded in plan.json (AdamW unless
    only bitsandbytes' paged 8-bit AdamW fits; chosen only with ``parallel.strategy: auto``)."""
    if spec.train.optimizer != "auto":
        return spec.train.optimizer
    if spec.parallel.strategy != "auto":
        return "adamw"
    try:
        return str(json.loads(rd.plan_file.read_text())["strategy"].get("optimizer", "adamw"))
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        from workbench.plan import plan

        return plan(spec).strategy.optimizer


def resolved_in_backward(spec: RunSpec, rd: RunDir) -> bool:
    """``train.optimizer_in_backward``, or for "auto" the planner's choice recorded in plan.json
    (only for a full fine-tune under ``parallel.strategy: auto``, where only it fits)."""
    wanted = spec.train.optimizer_in_backward
    if wanted != "auto":
        return bool(wanted)
    if spec.method.kind != "full" or spec.parallel.strategy != "auto":
        return False
    try:
        return bool(json.loads(rd.plan_file.read_text())["strategy"].get("in_backward", False))
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        from workbench.plan import plan

        return plan(spec).strategy.in_backward


def run_precision(spec: RunSpec, rd: RunDir) -> Precision:
    """The precision this rank trains in (workbench.spec.precision), with the optimizer in
    backward as resolved: the same decision for the model's load and the Trainer's AMP."""
    return resolve_precision(spec.model.dtype, spec.method.kind, local_device_kind(),
                             in_backward=resolved_in_backward(spec, rd),
                             master_weights=spec.train.master_weights)


def deepspeed_config(parallel: ParallelSpec, cuda: bool) -> dict[str, Any] | None:
    """The Trainer's DeepSpeed config for a ZeRO strategy, or None for plain DDP."""
    if parallel.strategy in ("ddp", "auto"):
        return None
    stage = int(parallel.strategy[-1])
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": cuda, "contiguous_gradients": True}
    if parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if parallel.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if stage == 3:
        # Save full 16-bit weights at the end so adapter/ and model/ load without DeepSpeed.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        # Both follow TrainingArguments' bf16/fp16, which workbench.spec.precision sets (fp16 on V100/T4).
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,
    }
    if parallel.offload_optimizer and not cuda:
        # DeepSpeedCPUAdam would need a 3-minute JIT build; on a CPU-only machine the Trainer's
        # torch AdamW already runs on the CPU, so offloading it changes nothing but the build.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for its CPU shared-memory all-reduce
# A JIT build of an op takes minutes; a lock this old was left by a build that was killed.
STALE_LOCK_S = 30 * 60


def clear_stale_extension_locks(max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove the ``lock`` files that killed JIT builds left in the torch extensions folder.

    DeepSpeed builds some ops on first use (fused Adam, CPU Adam, ...) through torch's
    ``cpp_extension``, which holds ``<extensions dir>/<op>/lock`` while it builds. A build killed
    half-way (a cancelled run, a preempted node) leaves the lock, and every later build of that
    op waits for it forever, printing nothing. Locks older than any real build are removed, with
    a line in the rank's log saying which.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()  # holds one folder per Python/CUDA flavour
    now, removed = time.time(), []
    for lock in [*Path(root).glob("*/lock"), *Path(root).glob("*/*/lock")]:
        try:
            if now - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(lock)
                print(f"removed a stale build lock left by a killed build: {lock}", flush=True)
        except FileNotFoundError:  # another rank was first
            continue
    return removed


def install_cpu_deepspeed_shim() -> None:
    """Make DeepSpeed on CPU (gloo) count every rank and build nothing at start-up.

    Without CUDA, accelerate's ``PartialState._prepare_backend`` finds no backend, so it counts
    one process while DeepSpeed sees all of them, and the Trainer fails its batch-size check
    (``train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size``).

    DeepSpeed's CPU communicator also JIT-compiles a shared-memory all-reduce op
    (``deepspeed_shm_comm``) into ``~/.cache/torch_extensions`` on every new install. Each rank
    races for that build's lock file, and a build killed half-way leaves the lock behind: every
    later run then waits on it forever, silently. gloo's all-reduce is what the Trainer needs, so
    the op is switched off.

    Only applied when no CUDA device exists and torchrun set LOCAL_RANK.
    """
    import torch

    if torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_workbench_cpu_shim", False):
        return

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                         backend: str | None = None) -> tuple[str, Any]:
        backend_name, dist_type = original(self, cpu, sagemaker_dp, backend)
        if backend_name is None:
            return "gloo", DistributedType.MULTI_CPU
        return backend_name, dist_type

    _prepare_backend._workbench_cpu_shim = True  # type: ignore[attr-defined]
    PartialState._prepare_backend = _prepare_backend  # type: ignore[method-assign]
