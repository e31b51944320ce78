"""What the trainer will run for a strategy, as the plan models it: its fast paths (the same
resolver the trainer calls, :mod:`workbench.train.fastpath`) and their memory effects on a
:class:`~workbench.plan.memory._Setup`, and the strategies in the order memory savers are
reached for, each with its time cost. Sources: ``docs/planning.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from workbench.plan.memory import Strategy, _Setup
from workbench.plan.result import Candidate
from workbench.spec import RunSpec
from workbench.spec.precision import Precision
from workbench.targets.gpus import GpuType

if TYPE_CHECKING:
    from workbench.train.fastpath import FastPaths


def fast_paths(spec: RunSpec, on_gpu: bool, gpu: GpuType, precision: Precision,
                st: Strategy | None = None) -> FastPaths:
    """What the trainer will turn on for strategy ``st`` (the spec's when None): the resolver
    :mod:`workbench.train.fastpath` the trainer itself calls. A GPU run planned from a machine
    without CUDA (another target, or trying a card) trains where what is installed is not
    known here, so package-dependent paths are taken as present and stated so."""
    from workbench.train.fastpath import planned_device, resolve_fast_paths

    p = st.parallel_spec() if st is not None else spec.parallel
    optimizer = st.optimizer if st is not None else (
        "adamw" if spec.train.optimizer == "auto" else spec.train.optimizer)
    here = spec.target == "local" and (not on_gpu or _cuda_here())
    # A strategy without master weights loads them in bf16 (flash-attention 2 can take them).
    load_dtype = "bfloat16" if st is not None and st.weights_16bit else precision.load_dtype
    return resolve_fast_paths(
        spec.train.fast, planned_device(on_gpu, gpu.bf16, here), None,
        load_dtype, stage=spec.method.stage,
        zero_stage=int(p.strategy[-1]) if p.strategy.startswith("zero") else 0,
        offload_optimizer=p.offload_optimizer, optimizer=optimizer)


def tier(st: Strategy) -> int:
    """Where ``st`` stands in the order memory savers are reached for on a card: AdamW with the
    states on the card (DDP, ZeRO) 0, an 8-bit/paged AdamW 1, then the same two stepped in
    backward with bf16 weights (full fine-tuning) 2 and 3, optimizer offload 4, parameter
    offload 5. Gradient checkpointing and the fused loss are the spec's and the fast paths'."""
    if st.offload_params:
        return 5
    if st.offload_optimizer:
        return 4
    return (2 if st.in_backward or st.weights_16bit else 0) + (st.optimizer != "adamw")


def ladder(mine: list[Candidate], chosen: Candidate, on_gpu: bool) -> list[str]:
    """The memory savers of this method in the order they are reached for, each with its memory
    and its time against the fastest strategy (one line), and what parameter offload costs."""
    if not on_gpu or not mine or any(c.hours is None for c in mine):
        return []
    ranked = sorted(mine, key=lambda c: (tier(c.strategy), c.hours or 0.0))
    fastest = min(mine, key=lambda c: c.hours or 0.0)
    base = fastest.hours or 1.0
    parts = [f"{c.strategy.label} {c.memory.total:.1f} GiB "
             f"{'fits' if c.fits else 'does not fit'}, x{(c.hours or 0.0) / base:.2f} time"
             for c in ranked]
    out = ["strategies, reached for in this order: " + "; ".join(parts)]
    if chosen.strategy.offload_params:
        plain = [c for c in mine if not c.strategy.offload_params]
        best = min(plain, key=lambda c: c.memory.total) if plain else None
        if best is not None and best.hours:
            out.append(f"parameter offload is {(chosen.hours or 0.0) / best.hours:.1f}x slower "
                       f"than {best.strategy.label} ({best.memory.total:.1f} GiB, does not fit): "
                       "every weight crosses PCIe each step")
    return out


def _cuda_here() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def with_fast_paths(s: _Setup, fast: FastPaths) -> _Setup:
    """``s`` with the memory effects of the trainer's fast paths (workbench.plan.memory)."""
    fused = fast.liger and (fast.liger_config or {}).get("fused_linear_cross_entropy", True)
    return replace(s, fused_loss=bool(fused), liger=fast.liger,
                   flash_attention=fast.attention == "flash_attention_2",
                   eager_attention=fast.attention == "eager")
