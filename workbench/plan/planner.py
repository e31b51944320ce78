"""The planner: every strategy evaluated for a spec, the one to run chosen, time and cost.

:func:`plan` resolves the GPU type, the model shape and the data estimate
(:mod:`~workbench.plan.inputs`), evaluates every method x strategy x offload x optimizer
combination (memory, then time and cost), picks the fastest that fits with a safety margin in
the order memory savers are reached for (:func:`workbench.plan.paths.tier`), and attaches the
suggestions of :mod:`~workbench.plan.suggest`. Launch refuses a plan that does not fit
(:func:`check_fits`); ``parallel.strategy: auto`` asks :func:`choose_strategy`.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Literal

from workbench.errors import BudgetError, FastPathError, PlanError
from workbench.plan.inputs import _setup as _setup
from workbench.plan.inputs import optimizers_of, precision_of, resolve_gpu, steppings_of
from workbench.plan.memory import (
    MemoryBreakdown,
    Strategy,
    all_strategies,
    estimate_memory,
    paged_spill_gib,
    safety_margin_gib,
    unsupported,
)
from workbench.plan.paths import fast_paths as _fast_paths
from workbench.plan.paths import ladder as _ladder
from workbench.plan.paths import tier
from workbench.plan.paths import with_fast_paths as _with_fast_paths
from workbench.plan.result import Candidate, Plan
from workbench.plan.scoring_time import scoring_seconds, validation_of
from workbench.plan.shape import ModelShape, model_shape
from workbench.plan.stage import stage_cost, stage_data, stage_memory, stage_time_factor
from workbench.plan.suggest import suggestions
from workbench.plan.timing import (
    _INTER_NODE_GBPS,
    DataEstimate,
    _Run,
    estimate_data,
    eval_seconds,
    paging_seconds,
    step_rows,
    step_seconds,
)
from workbench.runs.budget import billed_units, check_enforceable, unit_price
from workbench.runs.startup import finish_estimate, startup_estimate
from workbench.spec import RunSpec
from workbench.spec.sections import ParallelSpec
from workbench.targets.gpus import GpuType


def _evaluate(spec: RunSpec, gpu: GpuType, on_gpu: bool, shape: ModelShape,
              data: DataEstimate) -> Plan:
    res = spec.resources
    # Activations are sized by the longest batch the data can produce: its longest example
    # (padding goes to the batch's longest), max_length when packed or when lengths are unknown.
    seq_mem = data.longest or spec.data.max_length
    s = _setup(spec, shape, on_gpu, seq_mem, gpu)
    if on_gpu:
        capacity = gpu.memory_gib
        n_devices = res.gpus_per_node * res.nodes
    else:
        capacity = gpu.memory_gib / res.procs_per_node  # every process shares the host's RAM
        n_devices = (os.cpu_count() or 1) * res.nodes
    # The bill's own rule (workbench.runs.budget), asked for the card this plan is for.
    price, currency, _ = unit_price(spec, gpu.name if on_gpu else None)
    assumptions = []
    if price is None:
        currency = spec.budget.currency
    elif currency != spec.budget.currency:
        assumptions.append(f"prices in the GPU table are in {currency}, the budget in "
                           f"{spec.budget.currency}: cost shown in {currency}")
    assumptions.append(
        f"activations sized at {seq_mem} tokens per sequence: the longest example of "
        f"{data.longest_of} (max_length {spec.data.max_length})" if data.longest else
        f"activations sized at max_length {spec.data.max_length}"
        + (" (packed)" if spec.data.packing else " (example lengths unknown)"))
    margin = safety_margin_gib(capacity)
    precision = precision_of(spec, on_gpu, gpu)  # the same resolution _setup made
    assumptions.append("precision: " + precision.reason)
    fast_at = len(assumptions)  # the chosen strategy's fast paths go here, once it is chosen
    global_batch = spec.train.batch_size * spec.train.grad_accum * res.world_size
    # What a step really carries: fewer rows than the batch when the split is short of it on one
    # process, its rows repeated to fill every rank's batch on several (timing.step_rows).
    rows_per_step, per_epoch = (step_rows(data.rows, spec.train.batch_size, spec.train.grad_accum,
                                          res.world_size) if data.rows is not None
                                else (global_batch, None))
    tokens_per_step = int(round(rows_per_step * data.tokens_per_example))
    if spec.train.max_steps is not None:
        steps: int | None = spec.train.max_steps
    elif per_epoch is not None:
        steps = max(1, math.ceil(spec.train.epochs * per_epoch))
    else:
        steps = None
    # The clock: the target's calibration (else the table), then what earlier runs measured.
    # A CPU run on a machine never measured measures it first (workbench.plan.calibrate).
    from workbench.plan.calibrate import first_plan_here, time_basis
    from workbench.plan.history import correction
    from workbench.plan.stepclock import planned as measured_step

    first_plan_here(spec.target, on_gpu, precision.compute_dtype, shape.hidden)
    tb = time_basis(spec.target, gpu, on_gpu, precision.compute_dtype, shape.hidden,
                    cores=os.cpu_count() or 1)
    time_gpu, device_key = tb.gpu, tb.device_key
    measured, step_m, step_line = measured_step(spec, shape, on_gpu, precision.compute_dtype,
                                                device_key, data.tokens_per_example)
    step_range = None  # (low, high) seconds when the step is a first guess
    if step_m is None and not on_gpu:  # a small model's first plan: its bare step timed here
        from workbench.plan.firststep import first_step
        from workbench.plan.stepclock import rank_threads, run_key

        step_m, step_range, step_line = first_step(
            spec, shape, run_key(spec, shape, on_gpu, precision.compute_dtype, device_key),
            data.tokens_per_example, rank_threads(spec, on_gpu), spec.resources.procs_per_node)
    assumptions.append(tb.line + step_line + (
        f"; memory per process from the same step's peak ({measured.peak_gib:.2f} GiB at "
        f"{measured.seq} tokens per example)" if measured and measured.peak_gib and not on_gpu
        else ""))
    shape_key = f"{shape.model_id}:{shape.params}"
    corr = correction(spec.target, device_key, shape_key, spec.method.kind, res.world_size)
    time_scale, startup_scale = (corr.step, corr.startup) if corr else (1.0, 1.0)
    trainable = shape.params if spec.method.kind == "full" else shape.lora_params(
        spec.method.lora_r, spec.method.target_modules)
    finish = corr.finish if corr and corr.finish is not None else finish_estimate(
        spec, shape.params, trainable, load_dtype=precision.load_dtype,
        save_bytes_per_s=tb.save_rate)
    if corr:
        assumptions.append(corr.line(spec.target))
    run = _Run(tokens_per_step, steps, time_gpu, n_devices, on_gpu, tb.optimizer_rate)
    # What the bill counts: cards, or processes on CPU (workbench.runs.budget bills process-core-hours),
    # held from the supervisor's start to its exit, so start-up and release are paid too.
    units = billed_units(spec)
    link = (_INTER_NODE_GBPS if res.nodes > 1 else time_gpu.interconnect_gbps) * 1e9
    model_startup = startup_estimate(spec, params=shape.params,
                                     python_s=measured.import_s if measured else None,
                                     load_dtype=precision.load_dtype,
                                     load_bytes_per_s=tb.load_rate, link_bytes_per_s=link,
                                     trainable=trainable)
    startup = {k: (v * startup_scale if v is not None else None) for k, v in model_startup.items()}
    startup_total = sum(v for v in startup.values() if v)
    startup_h = (startup_total + finish) / 3600  # held before the first step and after the last

    def priced(hours: float | None) -> float | None:
        if hours is None or price is None:
            return None
        return (hours + startup_h) * units * price
    # Time at the average padded length (memory above at the longest).
    s_time = _setup(spec, shape, on_gpu, int(max(1, data.tokens_per_example)), gpu)
    # dpo/orpo/kto/grpo: reference model, paired sequences, generations (workbench.plan.stage).
    stage = stage_cost(spec, data.tokens_per_example)
    stage_x = stage_time_factor(stage, spec.method.kind, data.tokens_per_example)

    # On CPU a measured step's peak resident memory (the allocator's and the libraries' own
    # included) corrects the formula's: their difference at the measured tokens per example goes
    # to the overhead of the strategy it measured, DDP.
    ddp = Strategy(spec.method.kind, "ddp", False, False)
    mem_fix = (measured.peak_gib - estimate_memory(
        _setup(spec, shape, on_gpu, measured.seq, gpu), ddp).total
               if measured and measured.peak_gib and not on_gpu else None)

    def memory_of(st: Strategy) -> MemoryBreakdown:
        mem = estimate_memory(_with_fast_paths(s, _fast_paths(spec, on_gpu, gpu, precision, st)),
                              st)
        if mem_fix is not None and st == ddp:
            mem = replace(mem, overhead=max(0.0, mem.overhead + mem_fix))
        return stage_memory(mem, stage, shape, s.compute_bytes,
                            s.world if st.parallel == "zero3" else 1)

    # A measured step of this run's shape sets the clock; the FLOPs model ranks the strategies.
    # The measurement is of full micro-batches: the FLOPs model carries it to a step of fewer rows.
    full = replace(run, tokens_per_step=int(round(global_batch
                                                              * data.tokens_per_example)))
    step_x = step_m / step_seconds(s_time, Strategy(spec.method.kind, "ddp", False, False), full
                                   )[0] if step_m else 1.0

    def spill_of(st: Strategy) -> float:
        """GiB of a paged optimizer's states that page through host RAM each step."""
        return paged_spill_gib(memory_of(st), capacity) if st.optimizer == "paged_adamw_8bit" \
            else 0.0

    def seconds_of(st: Strategy) -> tuple[float, float]:
        secs, flops = step_seconds(s_time, st, run)
        return (secs + paging_seconds(spill_of(st))) * stage_x * step_x, flops * stage_x

    # Validation passes are held and billed like steps (forward only, corrected like them).
    eval_s = eval_seconds(spec, s_time, run, data.rows, data.tokens_per_example,
                          steps) * stage_x * step_x
    # The run's own eval: scoring, rank 0 while every unit is held (workbench.plan.scoring_time).
    val_rows, prompt_tokens = validation_of(spec, data)
    sc = scoring_seconds(spec, shape, measured, on_gpu=on_gpu, gpu=time_gpu,
                         prompt_tokens=prompt_tokens,
                         validation_rows=val_rows, steps=steps,
                         example_tokens=data.tokens_per_example)
    candidates = []
    steppings = steppings_of(spec, on_gpu, gpu)
    for st in all_strategies(res.world_size, optimizers_of(spec, on_gpu), steppings):
        try:
            mem = memory_of(st)
        except FastPathError:
            if spec.train.optimizer != "auto" or st.optimizer == "adamw":
                raise  # what the spec asks for cannot run there: say so now
            continue  # an 8-bit optimizer ``auto`` may reach for that the target cannot run
        secs = seconds_of(st)[0] * time_scale
        hours = (secs * steps + eval_s * time_scale + sc.seconds) / 3600 if steps else None
        fits = mem.total <= capacity - margin and unsupported(st) is None
        candidates.append(Candidate(st, mem, fits, hours, priced(hours)))

    wanted = spec.parallel
    reasons: list[str] = []
    mine = [c for c in candidates if c.strategy.method == spec.method.kind]
    if wanted.strategy == "auto":
        fitting = [c for c in mine if c.fits]
        # Memory savers in the order practitioners reach for them (paths.tier): AdamW with its
        # states on the card, an 8-bit/paged AdamW, the two stepped in backward over bf16
        # weights, optimizer offload, parameter offload (every weight over PCIe each step);
        # within the first tier that fits, cheapest = fastest (cost is time x cards), among
        # equals the simpler one (list order).
        first = min((tier(c.strategy) for c in fitting), default=0)
        pool = [c for c in fitting if tier(c.strategy) == first]
        chosen = min(pool, key=lambda c: c.hours or 0.0) if pool else min(
            [c for c in mine if unsupported(c.strategy) is None], key=lambda c: c.memory.total)
        reasons.append("parallel: auto -> " + (
            f"{chosen.strategy.label} is the fastest strategy that fits" + (
                "" if first == min(tier(c.strategy) for c in mine) else " once AdamW with its "
                "states on the card does not (memory savers reached for in order: 8-bit/paged "
                "AdamW, the optimizer in backward with bf16 weights, optimizer offload, "
                "parameter offload)")
            if fitting else f"nothing fits; {chosen.strategy.label} needs the least memory"))
    else:
        target = Strategy(spec.method.kind, wanted.strategy, wanted.offload_optimizer,
                          wanted.offload_params, optimizers_of(spec, on_gpu)[0],
                          *steppings[0])
        chosen = next((c for c in mine if c.strategy == target), None)  # type: ignore[assignment]
        if chosen is None:
            # e.g. ZeRO-1/2/3 without offload on one process, or ddp + offload: still evaluate.
            mem = memory_of(target)
            secs = seconds_of(target)[0] * time_scale
            hours = (secs * steps + eval_s * time_scale + sc.seconds) / 3600 if steps else None
            chosen = Candidate(target, mem, mem.total <= capacity - margin, hours, priced(hours))
            if target.parallel == "ddp" and (target.offload_optimizer or target.offload_params):
                chosen.fits = False
                reasons.append("offloading needs DeepSpeed: use parallel.strategy zero2 or zero3")
            if target.offload_params and target.parallel != "zero3":
                chosen.fits = False
                reasons.append("parallel.offload_params needs parallel.strategy: zero3")
        if unsupported(target):
            chosen.fits = False
            reasons.append(str(unsupported(target)))
        reasons.append(f"parallel.strategy: {wanted.strategy} as the spec says")

    fast = _fast_paths(spec, on_gpu, gpu, precision, chosen.strategy)
    assumptions.insert(fast_at, f"{fast.line()} ({'; '.join(fast.notes)})")
    if chosen.strategy.in_backward:  # the precision the trainer resolves with it
        ran = precision_of(spec, on_gpu, gpu, True)
        assumptions[fast_at - 1] = "precision: " + ran.reason
        reasons.append("optimizer in backward: each parameter is stepped as its gradient "
                       "arrives and the gradient freed (one parameter's gradient alive, no "
                       "gradient clipping or accumulation)")
    if chosen.strategy.weights_16bit:
        reasons.append("bf16 weights without fp32 master copies: updates smaller than bf16 "
                       "resolves (~1/256 of a weight) are lost, so small learning rates may "
                       "stall; train.master_weights: fp32 keeps them, at 2 more bytes per weight")
    reasons.extend(_ladder(mine, chosen, on_gpu))
    mem = chosen.memory
    unit = "GPU" if on_gpu else "process"
    if chosen.fits:
        reasons.append(f"peak {mem.total:.1f} GiB per {unit} leaves "
                       f"{capacity - mem.total:.1f} GiB of {capacity:.1f} free "
                       f"(margin {margin:.1f})")
    else:
        biggest = max(MemoryBreakdown.COMPONENTS, key=lambda c: getattr(mem, c))
        reasons.append(f"peak {mem.total:.1f} GiB per {unit} exceeds {capacity - margin:.1f} GiB "
                       f"usable of {capacity:.1f} ({gpu.name}, keeping {margin:.1f} free); "
                       f"largest part: {biggest} {getattr(mem, biggest):.1f} GiB")
    spill = spill_of(chosen.strategy)
    if mem.paged:
        reasons.append(f"paged 8-bit AdamW states: {mem.paged:.1f} GiB outside torch's allocator; "
                       + (f"{spill:.1f} GiB do not fit beside the rest and page through host RAM "
                          f"each step (~{paging_seconds(spill):.2f} s over PCIe)" if spill else
                          "they fit in the card's free memory"))
    if mem.host_offloaded:
        # Not part of `fits`: the target's host RAM is not known here (a remote node's may differ).
        reasons.append(f"offloading needs ~{mem.host_offloaded * res.procs_per_node:.0f} GiB of "
                       f"host RAM per node ({mem.host_offloaded:.1f} GiB per process)")
    if steps is None:
        reasons.append("time and cost unknown: the number of training rows is unknown; "
                       "set train.max_steps")

    limit = spec.budget.limit
    refusal = None
    try:
        check_enforceable(spec)
    except BudgetError as exc:  # launch refuses such a limit: say so before anyone tries
        refusal = str(exc)
        reasons.append(f"launch will refuse this budget: {refusal}")
    if refusal is None and chosen.hours is not None and price is None:
        reasons.append(f"no price for {gpu.name}: set budget.price_per_gpu_hour or edit gpus.yaml")
    verdict: Literal["within budget", "over budget", "no limit", "unknown"]
    if limit is None:
        verdict = "no limit"
    elif chosen.cost is None or refusal is not None:
        verdict = "unknown"
    else:
        verdict = "within budget" if chosen.cost <= limit else "over budget"

    reasons.extend(stage.notes)
    model_step, flops_step = seconds_of(chosen.strategy)
    clock = {"target": spec.target, "device": device_key, "shape": shape_key,
             "method": spec.method.kind, "world_size": res.world_size,
             "model_step_s": model_step, "model_startup_s": sum(v for v in model_startup.values()
                                                                if v),
             "model_eval_s": eval_s, "steps": steps,
             "step_s": model_step * time_scale, "eval_s": eval_s * time_scale,
             "step_range_s": [model_step * x / step_m for x in step_range]
             if step_range and step_m and not corr else None,
             "startup_s": startup_total, "finish_s": finish,
             "scoring_s": sc.seconds, "scoring": sc.line,
             "total_s": startup_total + (model_step * steps + eval_s) * time_scale + sc.seconds
             + finish if steps else None,
             "basis": "; ".join(assumptions[-2 if corr else -1:]),
             "earlier_runs": corr.runs if corr else 0,
             "earlier_shapes": list(corr.shapes) if corr else [], "calibration": tb.calibration}
    assumptions.append(sc.line)
    return Plan(
        model_id=spec.model.id, model_source=shape.source, params=shape.params,
        trainable_params=trainable, gpu_type=gpu.name, device="gpu" if on_gpu else "cpu",
        devices_per_node=res.gpus_per_node if on_gpu else res.procs_per_node, nodes=res.nodes,
        world_size=res.world_size, memory=mem, capacity_gib=capacity, safety_margin_gib=margin,
        fits=chosen.fits, strategy=chosen.strategy, reasons=reasons, candidates=candidates,
        tokens_per_step=tokens_per_step, steps=steps,
        total_tokens=tokens_per_step * steps if steps else None,
        flops=flops_step * steps if steps else None, hours=chosen.hours, cost=chosen.cost,
        currency=currency, price_per_hour=price, budget_limit=limit, budget_verdict=verdict,
        suggestions=[], data_note=data.note, assumptions=assumptions,
        data_tokens=data.tokens, startup_s=startup,
        startup_cost=startup_h * units * price if price is not None else None,
        clock=clock, memory_seq_len=seq_mem,
    )


def plan(spec: RunSpec | dict | str | Path | None = None, *,
         gpu_type: str | None = None, longest: int | None = None) -> Plan:
    """Plan ``spec``: memory per GPU for every strategy, the choice, time, cost and verdict.

    ``spec`` takes the forms ``launch`` takes (a RunSpec, a mapping, a YAML path; None: the
    embedded default). ``gpu_type`` overrides ``spec.resources.gpu_type`` (which defaults to the
    detected card). Raises SpecError for an invalid spec, UnknownGPUError for a card not in the
    table, ModelNotFoundError for an unknown model.
    ``longest`` is the longest training example in tokens when every row has been measured
    (launch passes it after tokenising, when the sample the plan read missed longer rows).
    """
    spec = RunSpec.coerce(spec)
    gpu, on_gpu = resolve_gpu(spec, gpu_type)
    m = spec.model
    shape = model_shape(m.id, m.revision, m.trust_remote_code)
    data = estimate_data(spec)
    if longest is not None and not spec.data.packing:  # launch measured every row
        data = replace(data, longest=min(longest, spec.data.max_length),
                       longest_of="every training row")
    data = stage_data(spec, data)  # grpo trains on prompt + completion, G times per prompt
    p = _evaluate(spec, gpu, on_gpu, shape, data)
    p.suggestions = suggestions(spec, p, gpu, on_gpu, shape, data, _evaluate)
    from workbench.runs.wallet import Wallet

    wallet = Wallet.open()
    if wallet is not None:  # what launching it would hold of the credit left, or why not
        p.wallet_note = wallet.quote(spec, p.cost, p.startup_cost or 0.0)
    return p


def choose_strategy(spec: RunSpec, *, gpu_type: str | None = None) -> ParallelSpec:
    """The ParallelSpec ``parallel: auto`` resolves to: the fastest strategy that fits (or the
    least memory-hungry one when none does; :func:`check_fits` then refuses the run)."""
    auto = spec.updated(**{"parallel.strategy": "auto"})
    return plan(auto, gpu_type=gpu_type).strategy.parallel_spec()


def check_fits(p: Plan) -> None:
    """Raise PlanError, saying why and what to change, unless the plan fits."""
    if p.fits:
        return
    why = "; ".join(r for r in p.reasons if "exceeds" in r or "needs" in r) or "; ".join(p.reasons)
    fixes = "\n".join(f"  * {s.text}" for s in p.suggestions)
    raise PlanError(f"this run does not fit: {why}.\nTo make it fit:\n{fixes}\n"
                    "(launch with force=True to start it anyway)")
