"""What a plan is computed from: the card it is for (the spec's, the one asked for, or the one
visible here), the precision the trainer will resolve on it, and the :class:`_Setup` the memory
and time models read (model shape, batch, sequence length, world size, checkpointing).
"""

from __future__ import annotations

from workbench.errors import PlanError
from workbench.plan.memory import Optimizer, _Setup
from workbench.plan.shape import ModelShape
from workbench.spec import RunSpec
from workbench.spec.precision import DeviceKind, Precision, resolve_precision
from workbench.spec.stepping import why_not_in_backward
from workbench.targets.gpus import GpuType, get_gpu, gpu_table


def resolve_gpu(spec: RunSpec, gpu_type: str | None) -> tuple[GpuType, bool]:
    """(the card the plan is for, whether it is a GPU): the table's CPU entry for a CPU run."""
    table = gpu_table()
    if spec.resources.gpus_per_node == 0:
        return table["CPU"], False
    name = gpu_type or spec.resources.gpu_type
    if name is None:
        from workbench.targets.gpus import detect_gpu_type

        name = detect_gpu_type()
    if name is None:
        raise PlanError(
            "no GPU type to plan against: set resources.gpu_type (e.g. 'A100-80G'; known types: "
            f"{', '.join(n for n in table if n != 'CPU')}) or run where a GPU is visible"
        )
    return get_gpu(name, table), True


def _device(on_gpu: bool, gpu: GpuType | None) -> DeviceKind:
    return "cpu" if not on_gpu else "cuda-bf16" if gpu is None or gpu.bf16 else "cuda-fp16"


def precision_of(spec: RunSpec, on_gpu: bool, gpu: GpuType | None = None,
                 in_backward: bool = False) -> Precision:
    """The precision the trainer resolves for ``spec`` on that device, its optimizer stepped in
    backward or not (workbench.spec.precision)."""
    return resolve_precision(spec.model.dtype, spec.method.kind, _device(on_gpu, gpu),
                             in_backward=in_backward, master_weights=spec.train.master_weights)


def steppings_of(spec: RunSpec, on_gpu: bool, gpu: GpuType | None = None
                 ) -> tuple[tuple[bool, bool], ...]:
    """The (optimizer in backward, bf16 weights) pairs the plan may choose among: as
    ``train.optimizer_in_backward`` says; for ``auto`` stepping after backward, and under
    ``parallel.strategy: auto`` on a bf16 GPU also in backward where the run allows it
    (workbench.spec.stepping). The weights follow ``train.master_weights``."""
    wanted = spec.train.optimizer_in_backward
    if wanted != "auto":
        choices = [bool(wanted)]
    else:
        choices = [False]
        if (on_gpu and spec.parallel.strategy == "auto" and _device(on_gpu, gpu) == "cuda-bf16"
                and why_not_in_backward(spec.train, spec.method, spec.parallel,
                                        spec.resources) is None):
            choices.append(True)
    return tuple((ib, not precision_of(spec, on_gpu, gpu, ib).fp32_trainable
                  and spec.method.kind == "full") for ib in choices)


def _setup(spec: RunSpec, shape: ModelShape, on_gpu: bool, seq_len: int,
           gpu: GpuType | None = None) -> _Setup:
    precision = precision_of(spec, on_gpu, gpu)  # the trainer resolves the same way
    return _Setup(
        shape=shape,
        compute_bytes=precision.compute_bytes,
        load_bytes=precision.load_bytes,
        micro_batch=spec.train.batch_size,
        seq_len=seq_len,
        world=spec.resources.world_size,
        nodes=spec.resources.nodes,
        lora_r=spec.method.lora_r,
        targets=spec.method.target_modules,
        checkpointing=spec.train.gradient_checkpointing,
        on_gpu=on_gpu,
    )


def optimizers_of(spec: RunSpec, on_gpu: bool) -> tuple[Optimizer, ...]:
    """The optimizers the plan may choose among: ``train.optimizer`` as set; for ``auto`` AdamW,
    and on a GPU under ``parallel.strategy: auto`` also bitsandbytes' paged 8-bit AdamW."""
    wanted = spec.train.optimizer
    if wanted != "auto":
        return (wanted,)
    if on_gpu and spec.parallel.strategy == "auto":
        return ("adamw", "paged_adamw_8bit")
    return ("adamw",)
