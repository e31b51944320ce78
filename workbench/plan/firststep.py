"""The first plan's step of a small model on this machine: its real step, timed in the planner.

A small model's step is not its FLOPs: the Python and autograd dispatch of every module, the
optimizer over many small tensors, the Trainer's per-step work and DDP's all-reduce between the
ranks dominate it, and the calibration's layer throughput (:mod:`workbench.plan.calmeasure`)
measures none of them, so a fresh home's first plan of the built-in tiny model was off by up to
x6 either way (docs/planning.md, "the first plan on a machine"). This module owns
:func:`first_step`: when a local CPU run's model is small (under ``SMALL_PARAMS`` parameters) and
its step was never measured (:mod:`workbench.plan.stepclock`), it builds the model from its config
(random weights, nothing downloaded), applies the run's method, and times a bare training step of
it here (forward, backward, gradient clipping, AdamW, zero_grad) at the run's micro-batch x tokens
per example and threads per rank: well under a second for such a model. The Trainer's and DDP's
share of a step is then counted as ``TRAINER_EXTRA`` bare steps more, a ratio measured on this
kind of machine (not on each machine), so the plan says the step is a first guess until
``workbench.plan.calibrate(target, spec=spec)`` or a run measures it. The result is kept in
``WORKBENCH_HOME/calibration/firststep-TARGET.json`` under the run's step key and tokens per
example, so later plans reuse it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

SMALL_PARAMS = 30e6  # models up to this many parameters have their first step timed here
# What the Trainer adds to a step (DDP's all-reduce, the data loader, callbacks, logging), in
# bare steps of the model alone: a 2-rank run of the built-in tiny model stepped in 24-27 ms on
# an idle 2-core VM where its bare step took 12 ms alone and 12-13 ms in 2 processes at once
# (docs/planning.md).
TRAINER_EXTRA = 1.1
TOLERANCE = 0.25  # how far the real step may be from the guess (tests/test_first_plan.py)
_WARMUP, _READINGS = 2, 9  # a median of up to 9 steps: the first plan stays about a second longer
_READING_S = 1.0  # a slow step is read at least 3 times, and then only until this many seconds
MAX_TOKENS = 8192  # a micro-batch of more tokens is timed smaller and extended (bare_step)


def _file(target: str) -> Any:
    from workbench.plan.calstore import calibration_file

    path = calibration_file(target)
    return path.with_name("firststep-" + path.name)


def bare_step(spec: Any, seq: int, threads: int, ranks: int = 1) -> tuple[float, float]:
    """(alone, together): median seconds of one bare training step of ``spec``'s model (random
    weights, the run's method) at its micro-batch x ``seq`` tokens with ``threads`` CPU threads,
    in this process alone, and taken by ``ranks`` forked copies of this process at once, each
    waiting for the others after every step (as a synchronous data-parallel step waits for its
    slowest rank), so the ranks' share of the host's cores, and what else runs on it now, are in
    the time. A micro-batch of more than ``MAX_TOKENS`` tokens is timed at the largest batch
    under it and scaled to the run's batch (the tiny model at 1000 x 18 tokens: 13 % under its
    own step, docs/planning.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.plan.shape import _config_for

    cfg, _ = _config_for(spec.model.id, spec.model.revision, spec.model.trust_remote_code)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        torch.manual_seed(0)
        model: Any = AutoModelForCausalLM.from_config(
            cfg, trust_remote_code=spec.model.trust_remote_code)
        if spec.method.kind in ("lora", "qlora"):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=spec.method.lora_r, lora_alpha=spec.method.lora_alpha,
                lora_dropout=spec.method.lora_dropout, target_modules=spec.method.target_modules,
                task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        vocab = max(2, int(getattr(cfg, "vocab_size", 0) or 2))
        seq = max(1, seq)

        batch = spec.train.batch_size
        timed = min(batch, max(1, MAX_TOKENS // seq))
        ids = torch.randint(0, vocab, (timed, seq))

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        alone, readings = _median_step(step, lambda: None, _READINGS, adaptive=True)
        together = _timed(step, ranks, readings) if ranks > 1 else alone
        scale = batch / timed  # a larger micro-batch: its step grows with its examples
        return alone * scale, together * scale
    finally:
        torch.set_num_threads(before)


def _median_step(step: Any, wait: Any, readings: int, adaptive: bool = False
                 ) -> tuple[float, int]:
    """(median seconds of ``step`` then ``wait()`` after the warm-up steps, readings taken); when
    ``adaptive``, readings stop at three once they have taken ``_READING_S`` seconds."""
    for _ in range(_WARMUP):
        t0 = time.perf_counter()
        step()
        wait()
        if adaptive and time.perf_counter() - t0 > _READING_S / 4:
            break  # a slow step is warm after one
    taken: list[float] = []
    for _ in range(readings):
        t0 = time.perf_counter()
        step()
        wait()
        taken.append(time.perf_counter() - t0)
        if adaptive and len(taken) >= 3 and sum(taken) > _READING_S:
            break
    return statistics.median(taken), len(taken)


def _rank(step: Any, barrier: Any, out: Any, readings: int) -> None:
    os.setsid()  # as a run's ranks are: CPU time is shared between sessions first
    out.put(_median_step(step, barrier.wait, readings)[0])


def _timed(step: Any, ranks: int, readings: int) -> float:
    """Median seconds of ``step`` then a barrier, ``readings`` times in ``ranks`` forked processes
    at once (the slowest rank's figure); in this process when fork is not available."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        return _median_step(step, lambda: None, readings)[0]
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(step, barrier, out, readings), daemon=True)
             for _ in range(ranks)]
    for p in procs:
        p.start()
    try:
        return max(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def first_step(spec: Any, shape: Any, key: str, seq: float, threads: int, ranks: int = 1
               ) -> tuple[float | None, tuple[float, float] | None, str]:
    """(seconds per optimizer step of ``spec``'s run guessed from its bare step timed here, the
    range the real step is expected in, the plan's line), or (None, None, "") when the model is
    not small, or it cannot be built here."""
    if shape.params > SMALL_PARAMS or spec.target != "local":
        return None, None, ""
    n = max(1, int(round(seq)))
    path = _file(spec.target)
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        raw = raw if isinstance(raw, dict) else {}
    except (OSError, ValueError):
        raw = {}
    kept = raw.get(f"{key}:{n}")
    if not (isinstance(kept, list) and len(kept) == 2
            and all(isinstance(v, (int, float)) and v > 0 for v in kept)):
        try:
            kept = list(bare_step(spec, n, threads, ranks))
        except Exception:  # noqa: BLE001 - any failure leaves the FLOPs model's plan
            return None, None, ""
        raw[f"{key}:{n}"] = kept
        try:
            from workbench.runs.rundir import write_json_atomic

            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, raw)  # two plans at once each replace the whole file
        except OSError:
            pass
    alone, together = kept
    # Idle, the ranks each have a core and a step is the bare step alone plus the Trainer's
    # share; busy, they share what is left with the rest of the machine as the forked copies did
    # just now. The guess is halfway; the range pads both ends by the tolerance.
    idle = spec.train.grad_accum * (1 + TRAINER_EXTRA) * alone
    busy = spec.train.grad_accum * (max(together, alone) + TRAINER_EXTRA * alone)
    step = (idle + busy) / 2
    low, high = idle * (1 - TOLERANCE), busy * (1 + TOLERANCE)
    return step, (low, high), (
        f"; step {step:.3g} s, a first guess between {low:.3g} and {high:.3g} s: a bare step of "
        f"this model timed here at {n} tokens x {spec.train.batch_size} with {threads} "
        f"thread(s), {alone * 1e3:.3g} ms alone and {together * 1e3:.3g} ms in {ranks} "
        f"process(es) at once, plus {TRAINER_EXTRA:g} x the first for the Trainer and DDP "
        f"(`workbench targets check {spec.target}` with the spec, or a first run, measures it)")
