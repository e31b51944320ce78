"""The measured training step: a real step of the run's model, timed at calibration, for the plan.

A FLOPs model misses what dominates small models' steps (the lm_head and the loss over the whole
vocabulary, embeddings, LoRA's small matmuls, the optimizer, framework overhead), so
:func:`measure_step` builds the run's model from its config with 1 and 2 layers (random weights,
nothing downloaded), applies the run's method (LoRA on its target modules, or full), and times
forward + backward + gradient clipping + AdamW at the run's micro-batch x tokens per example (laid
out by the run's collator: a packed micro-batch is one row) with the run's attention kernel, dtype
and threads per rank, in as many fresh processes as the run has ranks on a node, all at once and
wrapped in DDP when there are several (so the host's cores and memory are shared as in the run, and
the gradient all-reduce is in the time). Seconds = a + b x layers, fitted on the two, extrapolated
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

_CALLS = 4  # timed steps per layer count, after one warm-up step
_SEQ_NEAR = 1.25  # a measurement at tokens per example within this factor is scaled, else unused
_GEN_TOKENS = (2, 8)  # forced new tokens of the two timed generate calls (prefill vs decode)


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
    # None in files written before scoring was measured: the planner then uses FLOPs.
    gen_prefill_s: float | None = None
    gen_token_s: float | None = None
    # heldout's first metrics call in a process: importing sacrebleu and rouge-score dominates it.
    metrics_s: float | None = None

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
                    v is not None and not v > 0 for v in (r.gen_prefill_s, r.gen_token_s, r.metrics_s)):
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
                 on_gpu: bool, ranks: int = 1) -> tuple[float, float, float, float, float, float]:
    """(seconds per step, of which forward + backward, a rank's import seconds, a generate call's
    prefill and per-new-token seconds, heldout's first metrics call) of the whole model, fitted
    on 1 and 2 layers of it, measured in ``ranks`` worker processes at once."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = json.dumps({"spec": spec.model_dump(mode="json"), "vocab": shape.vocab,
                      "layers": shape.layers, "seq": seq, "dtype": dtype,
                      "load_dtype": load_dtype, "on_gpu": on_gpu})
    procs = []
    t0 = time.time()
    for rank in range(ranks):
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads)), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WB_STEPCLOCK_T0": repr(t0), "WB_STEPCLOCK_JOB": job}
        if on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "workbench.plan.stepclock"],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired as exc:
            for q in procs:
                q.kill()
            raise CalibrationError("the step measurement took over 10 minutes: the machine is "
                                   "too busy to measure; try again later") from exc
        if p.returncode != 0:
            for q in procs:
                q.kill()
            tail = err.strip().splitlines()[-3:]
            raise CalibrationError(f"the step measurement failed: {' | '.join(tail)}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    # The slowest rank sets the pace of a synchronous step; rank 0 alone scores in the run.
    return (max(o["step_s"] for o in outs), max(o["fwd_bwd_s"] for o in outs),
            max(o["import_s"] for o in outs), outs[0]["gen_prefill_s"], outs[0]["gen_token_s"],
            outs[0]["metrics_s"])


def _worker() -> None:
    """One rank of the measurement (``python -m workbench.plan.stepclock``, its job in the environment)."""
    import os

    import peft  # noqa: F401 - what a rank imports before its first step, timed as its start
    import torch
    import transformers  # noqa: F401

    import_s = time.time() - float(os.environ["WB_STEPCLOCK_T0"])
    job = json.loads(os.environ["WB_STEPCLOCK_JOB"])
    from workbench.spec import RunSpec

    spec = RunSpec.coerce(job["spec"])
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        torch.distributed.init_process_group("nccl" if job["on_gpu"] else "gloo")
    fits = [(n, *_measure_layers(spec, job, n, world)) for n in (1, 2)]
    (l1, w1, f1, p1, d1, n1), (l2, w2, f2, p2, d2, n2) = fits
    n = job["layers"]

    def at_n(one: float, two: float, floor: float = 0.0) -> float:
        # a + b x layers through the two, b at least ``floor``, never below one
        return max(one, one + max(floor, two - one) * (n - l1) / (l2 - l1))

    whole = at_n(w1, w2)
    fwd_bwd = min(whole, at_n(f1, f2))
    if world > 1:
        torch.distributed.destroy_process_group()
    t0 = time.perf_counter()
    from workbench.evaluate.heldout import scores

    scores(["an answer of a few words"] * spec.train.batch_size,
           ["a reference"] * spec.train.batch_size)
    metrics_s = time.perf_counter() - t0
    print(json.dumps({"step_s": whole, "fwd_bwd_s": fwd_bwd, "import_s": import_s,
                      "gen_prefill_s": at_n(p1, p2),
                      # A decode step reads every weight once: a layer costs at least its share
                      # of the 1-layer model's bytes. Two layers' decode differ by a few ms on a
                      # big vocabulary, under the noise, and a clamped 0 left out every layer.
                      "gen_token_s": at_n(d1, d2, d1 * max(0, n2 - n1) / max(1, n1)),
                      "metrics_s": metrics_s}), flush=True)


def _measure_layers(spec: Any, job: dict[str, Any], layers: int, world: int
                    ) -> tuple[float, float, float, float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.plan.shape import _config_for

    cfg, _ = _config_for(spec.model.id, spec.model.revision, spec.model.trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:layers]
    on_gpu = bool(job["on_gpu"])
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    # The attention kernel the run's load_model asks for (workbench.train.fastpath), so the
    # packed batch below is attended as in the run (sdpa's block mask, or flash's varlen).
    model: Any = AutoModelForCausalLM.from_config(
        cfg, dtype=getattr(torch, job["load_dtype"]),
        trust_remote_code=spec.model.trust_remote_code,
        **_attention_kwargs(spec, cfg, job["load_dtype"])).to(dev)
    if spec.method.kind in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=spec.method.lora_r, lora_alpha=spec.method.lora_alpha,
            target_modules=spec.method.target_modules, task_type="CAUSAL_LM"),
            autocast_adapter_dtype=True)
    ids = torch.randint(0, max(2, job["vocab"]), (spec.train.batch_size, job["seq"]), device=dev)
    batch = _run_batch(spec, ids)
    ctx = (torch.autocast("cuda", dtype=getattr(torch, job["dtype"]))
           if on_gpu and job["dtype"] != job["load_dtype"] else _null())
    if spec.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(params, lr=1e-5)
    step = _time_step(trained, opt, params, batch, ctx, on_gpu)
    # After the step, as the run scores after its steps (and so the step is timed as before).
    weights = sum(p.numel() for p in model.parameters())
    return (*step, *_time_generate(model, ids, ctx, on_gpu), weights)


def _run_batch(spec: Any, ids: Any) -> dict[str, Any]:
    """The micro-batch as the run's collator (:class:`workbench.data.batches.Collator`) gives it
    to the model. Packed rows are laid end to end in ONE row with restarting ``position_ids``, so
    attention spans the whole micro-batch's tokens (sdpa builds a block-diagonal causal mask over
    all of them): time grows with micro-batch x tokens squared, not micro-batch x tokens squared
    per row as for separate rows. Each row is one example here (where its examples start inside
    a row does not change sdpa's dense cost)."""
    from workbench.data.batches import Collator

    rows = []
    for row in ids.tolist():
        r: dict[str, list[int]] = {"input_ids": row, "labels": row}
        if spec.data.packing:
            r["position_ids"] = list(range(len(row)))
        rows.append(r)
    return {k: v.to(ids.device) for k, v in Collator(pad_token_id=0)(rows).items()}


def _attention_kwargs(spec: Any, cfg: Any, load_dtype: str) -> dict[str, Any]:
    """``from_pretrained``'s attention argument of the run's fast paths on this device."""
    from workbench.errors import FastPathError
    from workbench.train.fastpath import local_device, resolve_fast_paths

    try:
        return resolve_fast_paths(spec.train.fast, local_device(),
                                  getattr(cfg, "model_type", None), load_dtype,
                                  stage=spec.method.stage).model_kwargs()
    except FastPathError:  # the run raises it at launch; time transformers' default meanwhile
        return {}


def _time_generate(model: Any, ids: Any, ctx: Any, on_gpu: bool) -> tuple[float, float]:
    """(prefill, per new token) seconds of greedy ``generate`` on the micro-batch ``ids``, as the
    run's scoring calls it; min_new_tokens forces every call to its full length (no early stop)."""
    import torch

    model.eval()
    mask = torch.ones_like(ids)
    took: dict[int, float] = {}
    with torch.no_grad(), ctx:
        for i, n in enumerate((_GEN_TOKENS[0], *_GEN_TOKENS, *_GEN_TOKENS)):
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
            if on_gpu:
                torch.cuda.synchronize()
            if i > 0:  # the first call warms up; the faster of two calls of each length counts
                took[n] = min(took.get(n, float("inf")), time.perf_counter() - t0)
    lo, hi = _GEN_TOKENS
    per_token = max(0.0, (took[hi] - took[lo]) / (hi - lo))
    return max(1e-6, took[lo] - lo * per_token), max(1e-6, per_token)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _time_step(model: Any, opt: Any, params: list[Any], batch: dict[str, Any], ctx: Any,
               on_gpu: bool) -> tuple[float, float]:
    """(forward+backward, whole step) seconds: one warm-up step, then _CALLS (every rank the
    same number: DDP's all-reduce pairs them); the median of each."""
    import statistics

    import torch

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    fb: list[float] = []
    whole: list[float] = []
    for i in range(_CALLS + 1):
        t0 = time.perf_counter()
        with ctx:
            loss = model(**batch).loss
        loss.backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if i > 0:  # the first step warms up (allocations, lazy initialisation)
            fb.append(t1 - t0)
            whole.append(t2 - t0)
    return statistics.median(fb), statistics.median(whole)


def calibrate_step(target: str, spec: Any, shape: Any, seq: int, dtype: str, load_dtype: str,
                   on_gpu: bool, device: str) -> StepMeasure:
    """Measure the run's step (and a rank's start) on this machine and store it under its key."""
    ranks = spec.resources.gpus_per_node if on_gpu else spec.resources.procs_per_node
    whole, fwd_bwd, import_s, prefill, per_token, metrics_s = measure_step(
        spec, shape, seq, dtype, load_dtype, rank_threads(spec, on_gpu), on_gpu, max(1, ranks))
    m = StepMeasure(run_key(spec, shape, on_gpu, dtype, device), seq, whole, fwd_bwd, import_s,
                    prefill, per_token, metrics_s)
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
    return m, step, (
        f"; step {step:.3g} s from a real step of this model measured here (1 and 2 of its "
        f"layers at {m.seq} tokens x {spec.train.batch_size} per rank, extrapolated to "
        f"{shape.layers})")


if __name__ == "__main__":
    _worker()
