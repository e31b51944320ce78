"""How a run's optimizer steps: ``train.optimizer_in_backward`` (each parameter's optimizer step
runs from its gradient hook during backward and the gradient is freed at once, so no full set of
gradients is ever held) and ``train.master_weights: none`` (pure bf16 weights, no fp32 master
copy), and the combinations a run cannot train with, each with what to set instead.

:class:`~workbench.spec.RunSpec` refuses an explicit bad combination (:func:`stepping_problem`);
the planner reaches for ``optimizer_in_backward: auto`` only where :func:`why_not_in_backward`
is None. What the weights are then kept in is :mod:`workbench.spec.precision`'s decision.
"""

from __future__ import annotations

from workbench.spec.sections import MethodSpec, ModelSpec, ParallelSpec, ResourceSpec, TrainSpec


def _deepspeed(parallel: ParallelSpec) -> bool:
    return (parallel.strategy.startswith("zero") or parallel.offload_optimizer
            or parallel.offload_params)


def why_not_in_backward(train: TrainSpec, method: MethodSpec, parallel: ParallelSpec,
                        resources: ResourceSpec) -> str | None:
    """Why a run of these sections cannot step its optimizer inside backward (None: it can)."""
    if method.kind != "full":
        return ("it is for method.kind full (LoRA's adapters have small gradients: there is "
                "nothing worth freeing)")
    if method.stage != "sft":
        return f"it is for method.stage sft (TRL's {method.stage} trainer steps its own way)"
    if train.grad_accum > 1:
        return ("each gradient is used and freed as it arrives, so nothing adds up over "
                "micro-batches: set train.grad_accum: 1 (and a larger train.batch_size)")
    if train.max_grad_norm:
        return ("clipping needs every gradient's norm before the first step: set "
                "train.max_grad_norm: 0 (or leave it unset)")
    if _deepspeed(parallel):
        return ("DeepSpeed ZeRO steps its own optimizer: set parallel.strategy: ddp (or auto) "
                "without offload")
    if resources.world_size > 1:
        return ("it runs in one process (DDP averages a gradient only after the step would "
                "have used it): set resources.gpus_per_node: 1 (processes_per_node: 1 on CPU) "
                "and nodes: 1")
    return None


def stepping_problem(model: ModelSpec, method: MethodSpec, train: TrainSpec,
                     parallel: ParallelSpec, resources: ResourceSpec) -> str | None:
    """What is wrong with the spec's explicit stepping knobs, as one line saying what to set."""
    if train.optimizer_in_backward is True:
        why = why_not_in_backward(train, method, parallel, resources)
        if why is not None:
            return (f"train.optimizer_in_backward is true, but {why}; or set "
                    "train.optimizer_in_backward: auto")
    if train.master_weights == "none":
        why = None
        if method.kind != "full":
            why = "it is for method.kind full (LoRA keeps fp32 adapters over a 16-bit base)"
        elif _deepspeed(parallel):
            why = ("DeepSpeed ZeRO keeps its own fp32 master copy: set parallel.strategy: ddp "
                   "(or auto) without offload")
        elif model.dtype in ("float32", "float16"):
            why = "pure 16-bit weights are bf16: set model.dtype: auto (or bfloat16)"
        if why is not None:
            return f"train.master_weights is none, but {why}; or set train.master_weights: auto"
    return None
