"""The measured training step: a real step of the run's model, timed at calibration, for the plan.

A FLOPs model misses what dominates small models' steps (the lm_head and the loss over the whole
vocabulary, embeddings, LoRA's small matmuls, the optimizer, framework overhead), so
:func:`measure_step` builds the run's model from its config with a few layers (random weights,
nothing downloaded), applies the run's method (LoRA on its target modules, or full), and times a
few steps of it through the run's own Trainer (:mod:`workbench.train.steprank`: the run's training
arguments, Trainer class, collator and per-step callbacks, so the Trainer's logging, collectives
and callbacks are in the time) at the run's micro-batch x tokens per example, with the run's
attention kernel, dtype and threads per rank, in as many fresh processes as the run has ranks on a
node, all at once (so the host's cores and memory are shared as in the run, and DDP's gradient
all-reduce is in the time). Seconds = a + b x layers, fitted on the two, extrapolated
to the model's layer count. The workers' own start (a fresh interpreter importing what a rank
imports) is timed too: the start-up the plan counts. So is the scoring the run's ``eval:`` does
(greedy ``generate`` of a batch of prompts, as :class:`~workbench.evaluate.sources.TransformersSource`
runs it in the run, at two forced new-token counts so prefill and per-token decode separate),
fitted on the layers the same way; :mod:`workbench.plan.scoring_time` turns it into seconds.

Measurements are stored in ``WORKBENCH_HOME/calibration/steps-TARGET.json``, keyed by what they
depend on (:func:`step_key`: the model shape, method, adapter, micro-batch, dtype, threads and
device), each with the tokens per example it was timed at; :func:`lookup` gives the planner the
one of this key whose tokens per example are nearest (within a factor 1.25, scaled linearly), so a
calibration of another shape is never used, and a file that cannot be read warns
(``CalibrationWarning``) and is ignored: the planner falls back to the FLOPs model.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from workbench.plan.calstore import CalibrationError, CalibrationWarning

_SEQ_NEAR = 1.25  # a measurement at tokens per example within this factor is scaled, else unused
# The layer counts the step is timed at: up to _WIDE layers and half as many, as long as the wider
# model's layers stay under _WIDE_PARAMS parameters. The first layers hide under the lm_head's
# fixed cost and the per-layer slope settles only past them, so a line through 1 and 2 (or 1 and
# 4) layers plans the step short (docs/planning.md).
_WIDE, _WIDE_PARAMS = 8, 1e9


def fit_layers(shape: Any) -> tuple[int, int]:
    """(fewer, more) layers of ``shape`` the step is measured at; the line through them is
    extrapolated to the model's ``shape.layers``."""
    per_layer = shape.params / max(1, shape.layers)  # an over-count: embeddings are in params
    more = max(2, min(shape.layers, _WIDE, int(_WIDE_PARAMS // max(1.0, per_layer))))
    return max(1, more // 2), more


@dataclass(frozen=True)
class StepMeasure:
    """One measured step shape: seconds per micro-batch step at ``seq`` tokens per example."""

    key: str
    seq: int
    step_s: float  # forward + backward + optimizer of one micro-batch, the whole model
    fwd_bwd_s: float  # of which forward + backward (what gradient accumulation repeats)
    import_s: float | None  # a fresh interpreter importing what a rank imports
    # One greedy generate call of a micro-batch of prompts of ``seq`` tokens, the whole model:
    # prefill (the prompt's forward and the call's overhead) and each new token's decode step.
    # None when the stored measurement has no such figure: the planner then uses FLOPs.
    gen_prefill_s: float | None = None
    gen_token_s: float | None = None
    # heldout's first metrics call in a process: importing sacrebleu and rouge-score dominates it.
    metrics_s: float | None = None
    # A CPU rank's peak resident memory (GiB) while it trained and generated, the whole model:
    # what the memory formula's CPU figure is corrected by (None on a GPU, or when not stored).
    peak_gib: float | None = None

    def at(self, seq: float, grad_accum: int) -> float:
        """Seconds per optimizer step at ``seq`` tokens per example (linear in tokens)."""
        x = seq / self.seq
        return x * (grad_accum * self.fwd_bwd_s + (self.step_s - self.fwd_bwd_s))


def step_key(shape: Any, method: str, lora_r: int, targets: Any, micro_batch: int, dtype: str,
             threads: int, checkpointing: bool, device: str, ranks: int) -> str:
    """What a step's time depends on besides the tokens per example, as one string."""
    fields = [shape.model_id, shape.params, shape.hidden, shape.layers, shape.vocab, method,
              lora_r if method != "full" else 0, targets if method != "full" else "",
              micro_batch, dtype, threads, checkpointing, device, ranks]
    return hashlib.sha1(json.dumps(fields, default=str).encode()).hexdigest()[:16]


def rank_threads(spec: Any, on_gpu: bool) -> int:
    """CPU threads one rank computes with: the launcher gives each of several ranks on a node one
    (as torchrun does) unless OMP_NUM_THREADS says otherwise; a lone rank takes every core."""
    import os

    if on_gpu:
        return 0
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    return 1 if spec.resources.procs_per_node > 1 else (os.cpu_count() or 1)


def run_key(spec: Any, shape: Any, on_gpu: bool, dtype: str, device: str) -> str:
    """The step key of ``spec``'s run on ``device`` (the planner's device key)."""
    ranks = spec.resources.gpus_per_node if on_gpu else spec.resources.procs_per_node
    return step_key(shape, spec.method.kind, spec.method.lora_r, spec.method.target_modules,
                    spec.train.batch_size, dtype, rank_threads(spec, on_gpu),
                    spec.train.gradient_checkpointing, device, ranks)


def _file(target: str) -> Any:
    from workbench.plan.calstore import calibration_file

    path = calibration_file(target)
    return path.with_name("steps-" + path.name)


def lookup(target: str, key: str, seq: float) -> StepMeasure | None:
    """The stored measurement of ``key`` nearest ``seq`` tokens per example, or None."""
    path = _file(target)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        rows = [StepMeasure(**r) for r in raw.get(key, [])]
        for r in rows:
            if not (r.step_s > 0 and 0 < r.fwd_bwd_s <= r.step_s and r.seq > 0) or any(
                    v is not None and not v > 0
                    for v in (r.gen_prefill_s, r.gen_token_s, r.metrics_s, r.peak_gib)):
                raise ValueError(f"non-positive or inconsistent times in {r}")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        warnings.warn(f"step measurement {path} not used: it cannot be read ({exc}); run "
                      f"workbench.plan.calibrate({target!r}, spec=spec) to measure again (the "
                      "planner uses the FLOPs model meanwhile)", CalibrationWarning, stacklevel=3)
        return None
    near = [r for r in rows if 1 / _SEQ_NEAR <= seq / r.seq <= _SEQ_NEAR]
    return min(near, key=lambda r: abs(r.seq - seq), default=None)


def store(target: str, m: StepMeasure) -> None:
    path = _file(target)
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(raw, dict):
            raw = {}
    except (OSError, ValueError):
        raw = {}  # a corrupt file is replaced by this measurement
    rows = [r for r in raw.get(m.key, []) if isinstance(r, dict) and r.get("seq") != m.seq]
    raw[m.key] = [*rows, m.__dict__]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    tmp.replace(path)


def measure_step(spec: Any, shape: Any, seq: int, dtype: str, load_dtype: str, threads: int,
                 on_gpu: bool, ranks: int = 1
                 ) -> tuple[float, float, float, float, float, float, float | None]:
    """(seconds per step, of which forward + backward, a rank's import seconds, a generate call's
    prefill and per-new-token seconds, heldout's first metrics call, a CPU rank's peak resident
    GiB) of the whole model, fitted on two layer counts of it (:func:`fit_layers`), measured in
    ``ranks`` worker processes at once."""
    import os
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    scratch = Path(tempfile.mkdtemp(prefix="wb-stepclock-"))  # the ranks' scratch run dirs
    job = json.dumps({"spec": spec.model_dump(mode="json"), "vocab": shape.vocab,
                      "layers": shape.layers, "fit_layers": fit_layers(shape), "seq": seq, "dtype": dtype,
                      "load_dtype": load_dtype, "on_gpu": on_gpu, "scratch": str(scratch)})
    procs, logs = [], []
    t0 = time.time()
    try:
        for rank in range(ranks):
            # Every rank sees the node's GPUs and takes LOCAL_RANK's, as under torchrun.
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads)), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE":
                   str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WB_STEPCLOCK_T0": repr(t0), "WB_STEPCLOCK_JOB": job}
            # Files, not pipes: the Trainer logs every step, and a full pipe would stall a rank
            # (and with it the other's collectives) while this reads the first.
            logs.append(scratch / f"rank-{rank}.out")
            with logs[-1].open("w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "workbench.train.steprank"],
                                              stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, text=True, env=env))
        outs = []
        for p, log in zip(procs, logs, strict=True):
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired as exc:
                raise CalibrationError("the step measurement took over 10 minutes: the machine "
                                       "is too busy to measure; try again later") from exc
            lines = log.read_text(errors="replace").strip().splitlines()
            if p.returncode != 0:
                raise CalibrationError(f"the step measurement failed: {' | '.join(lines[-3:])}")
            outs.append(json.loads(lines[-1]))
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    # The slowest rank sets the pace of a synchronous step; rank 0 alone scores in the run; the
    # plan's memory is per process, the largest.
    peaks = [o.get("peak_gib") for o in outs]
    return (max(o["step_s"] for o in outs), max(o["fwd_bwd_s"] for o in outs),
            max(o["import_s"] for o in outs), outs[0]["gen_prefill_s"], outs[0]["gen_token_s"],
            outs[0]["metrics_s"], None if None in peaks else max(peaks))


def calibrate_step(target: str, spec: Any, shape: Any, seq: int, dtype: str, load_dtype: str,
                   on_gpu: bool, device: str) -> StepMeasure:
    """Measure the run's step (and a rank's start) on this machine and store it under its key."""
    ranks = spec.resources.gpus_per_node if on_gpu else spec.resources.procs_per_node
    whole, fwd_bwd, import_s, prefill, per_token, metrics_s, peak = measure_step(
        spec, shape, seq, dtype, load_dtype, rank_threads(spec, on_gpu), on_gpu, max(1, ranks))
    m = StepMeasure(run_key(spec, shape, on_gpu, dtype, device), seq, whole, fwd_bwd, import_s,
                    prefill, per_token, metrics_s, peak)
    store(target, m)
    return m


def planned(spec: Any, shape: Any, on_gpu: bool, dtype: str, device: str,
            tokens_per_example: float) -> tuple[StepMeasure | None, float | None, str]:
    """(the stored measurement of this run's step, seconds per optimizer step from it, the plan's
    line); (None, None, "") when there is none."""
    m = lookup(spec.target, run_key(spec, shape, on_gpu, dtype, device), tokens_per_example)
    if m is None:
        return None, None, ""
    step = m.at(tokens_per_example, spec.train.grad_accum)
    few, more = fit_layers(shape)
    return m, step, (
        f"; step {step:.3g} s from a real step of this model measured here ({few} and {more} of "
        f"its layers at {m.seq} tokens x {spec.train.batch_size} per rank, extrapolated to "
        f"{shape.layers})")
