"""Suggestions: the concrete spec changes that would make a plan fit or cost less, each checked
by planning the changed spec again (a strategy, checkpointing, a smaller micro-batch, LoRA or
QLoRA, more or bigger cards, fewer steps) before it is offered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.errors import WorkbenchError
from workbench.plan.result import Plan, Suggestion
from workbench.plan.shape import ModelShape
from workbench.plan.timing import DataEstimate
from workbench.spec import RunSpec
from workbench.targets.gpus import GpuType, gpu_table

# The planner's evaluation of one spec on one card: (spec, gpu, on_gpu, shape, data) -> Plan.
Evaluate = Callable[[RunSpec, GpuType, bool, ModelShape, DataEstimate], Plan]


def suggestions(spec: RunSpec, p: Plan, gpu: GpuType, on_gpu: bool, shape: ModelShape,
                data: DataEstimate, evaluate: Evaluate) -> list[Suggestion]:
    """Concrete changes, each checked by re-planning the changed spec with ``evaluate``."""
    out: list[Suggestion] = []

    def check(changes: dict[str, Any], gpu_over: GpuType | None = None) -> Plan | None:
        try:  # a variant may be invalid, or ask a card for a dtype it lacks (bf16 on a T4)
            variant = spec.updated(**changes)
            return evaluate(variant, gpu_over or gpu, on_gpu, shape, data)
        except WorkbenchError:
            return None

    if not p.fits:
        if spec.parallel.strategy != "auto":
            q = check({"parallel.strategy": "auto", "parallel.offload_optimizer": False,
                       "parallel.offload_params": False})
            if q and q.fits:
                ps = q.strategy.parallel_spec()
                out.append(Suggestion(
                    f"use {q.strategy.label} (parallel.strategy: {ps.strategy}"
                    + (", offload_optimizer: true" if ps.offload_optimizer else "")
                    + (", offload_params: true" if ps.offload_params else "") + ")",
                    {"parallel.strategy": ps.strategy,
                     "parallel.offload_optimizer": ps.offload_optimizer,
                     "parallel.offload_params": ps.offload_params}))
        if not spec.train.gradient_checkpointing:
            q = check({"train.gradient_checkpointing": True})
            if q and q.fits:
                out.append(Suggestion("turn on gradient checkpointing "
                                      "(train.gradient_checkpointing: true; ~30% slower)",
                                      {"train.gradient_checkpointing": True}))
        bs = spec.train.batch_size
        if bs > 1:
            for smaller in sorted({bs // 2, bs // 4, 1} - {0}, reverse=True):
                accum = spec.train.grad_accum * bs // smaller
                q = check({"train.batch_size": smaller, "train.grad_accum": accum})
                if q and q.fits:
                    out.append(Suggestion(
                        f"train.batch_size {smaller} with train.grad_accum {accum} "
                        "(same global batch, less activation memory)",
                        {"train.batch_size": smaller, "train.grad_accum": accum}))
                    break
        for kind, label in (("lora", "use LoRA"), ("qlora", "use QLoRA")):
            if kind == spec.method.kind or (spec.method.kind == "qlora" and kind == "lora"):
                continue
            ch: dict[str, Any] = {"method.kind": kind, "parallel.strategy": "auto"}
            ch["model.quantization"] = "4bit" if kind == "qlora" else "none"
            q = check(ch)
            if q and q.fits:
                out.append(Suggestion(f"{label} (method.kind: {kind}): "
                                      f"{q.memory.total:.1f} GiB per GPU", ch))
                break
        if on_gpu:
            res = spec.resources
            for n in (2, 4, 8):
                if n <= res.gpus_per_node:
                    continue
                ch = {"resources.gpus_per_node": n, "parallel.strategy": "auto"}
                if res.processes_per_node is not None:
                    ch["resources.processes_per_node"] = n
                q = check(ch)
                if q and q.fits:
                    out.append(Suggestion(f"{n} GPUs (resources.gpus_per_node: {n}) with "
                                          f"{q.strategy.label}", ch))
                    break
            table = gpu_table()
            bigger = sorted((g for g in table.values() if g.name not in ("CPU", gpu.name)
                             and g.memory_gib > gpu.memory_gib),
                            key=lambda g: (g.price_per_hour is None, g.price_per_hour or 0,
                                           g.memory_gib))
            for g in bigger:
                q = check({"resources.gpu_type": g.name, "parallel.strategy": "auto"}, g)
                if q and q.fits:
                    out.append(Suggestion(f"a bigger card: resources.gpu_type {g.name} "
                                          f"({g.memory_gib:.0f} GiB) with {q.strategy.label}",
                                          {"resources.gpu_type": g.name,
                                           "parallel.strategy": "auto"}))
                    break
        if not out:
            out.append(Suggestion(
                "nothing tried fits: use a smaller model, a shorter data.max_length, or more "
                "GPUs/nodes"))
    if p.budget_verdict == "over budget" and p.cost and p.steps and p.budget_limit:
        fixed = p.startup_cost or 0.0  # start-up and release are paid whatever max_steps is
        eval_h = ((p.clock or {}).get("eval_s", 0.0) + (p.clock or {}).get("scoring_s", 0.0)) / 3600
        if p.hours:  # ~EVALS_PER_RUN validation passes whatever max_steps is: taken as fixed
            fixed += (p.cost - fixed) * eval_h / p.hours
        per_step = (p.cost - fixed) / p.steps
        steps = int((p.budget_limit - fixed) / per_step) if per_step > 0 else 0
        if steps >= 1:
            out.append(Suggestion(f"train.max_steps {steps:,} stays within the budget of "
                                  f"{p.budget_limit:,.2f} {p.currency}",
                                  {"train.max_steps": steps}))
        if spec.method.kind == "full":
            q = check({"method.kind": "lora", "parallel.strategy": "auto"})
            if q and q.cost is not None and q.fits and q.cost <= p.budget_limit:
                out.append(Suggestion(f"use LoRA: {q.cost:,.2f} {q.currency}",
                                      {"method.kind": "lora", "parallel.strategy": "auto"}))
        if on_gpu:
            for g in gpu_table().values():
                if g.name in ("CPU", gpu.name) or g.price_per_hour is None:
                    continue
                q = check({"resources.gpu_type": g.name, "parallel.strategy": "auto"}, g)
                if q and q.fits and q.cost is not None and q.cost <= p.budget_limit:
                    out.append(Suggestion(f"resources.gpu_type {g.name}: {q.cost:,.2f} "
                                          f"{q.currency}", {"resources.gpu_type": g.name,
                                                            "parallel.strategy": "auto"}))
                    break
    if p.steps is None:
        out.append(Suggestion("set train.max_steps so time and cost can be estimated"))
    return out
