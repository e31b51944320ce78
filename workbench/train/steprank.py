"""One rank of the plan's step measurement: the run's training step, timed through its own Trainer.

:mod:`workbench.plan.stepclock` starts this module (``python -m workbench.train.steprank``) in as
many processes as the run has ranks on a node, its job in the environment. Each builds the run's
model from its config with a few layers (``stepclock.fit_layers``), and
:func:`time_train_steps` trains it for a few steps with what :func:`workbench.train.run.main`
trains with: its ``training_arguments`` (:mod:`workbench.train.arguments`), its Trainer class
(:mod:`workbench.train.snapshotting`), its collator and its per-step
callbacks (metrics.jsonl and status.json, the snapshot and budget checks), in a scratch run
directory of its own. Every cost the run pays per step is then in the time: the Trainer's per-step
logging (loss and gradient-norm reads, token counts, each a collective across ranks), LoRA
dropout, the learning-rate schedule, the data loader and collation, the callbacks' writes. A hand
loop of forward + backward + clip + AdamW leaves these out and plans the Trainer's step short
(docs/planning.md). It also times the run's scoring (greedy ``generate`` on rank 0, as the run
scores, at two forced new-token counts so prefill and per-token decode separate) and heldout's
first metrics call; the plan side (stepclock) fits all of it over the layers and stores it. Here,
not in :mod:`workbench.plan`, because it runs the training code, which the plan must not import.

The scratch run differs from the run only where a measurement must: a few steps (``_WARM`` warm
up, then at least ``_CALLS`` and ``_MIN_TIMED_S`` seconds of them timed, the ranks agreeing when
to stop), one micro-batch per step (gradient accumulation is planned from the
forward + backward share), no evaluation, snapshots and the budget stop never fire (their per-step
checks still run), and DDP across ranks where the run would use ZeRO (its step is planned as DDP).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

_WARM = 2  # steps before the timed ones (the first allocates and initialises lazily)
_CALLS = 4  # timed steps at least: intervals between consecutive step ends
# ... and at least this many seconds of them, up to _MAX_STEPS steps: a small model's step takes
# a fraction of a second, and a few such intervals are too noisy to plan from (docs/planning.md).
_MIN_TIMED_S, _MAX_STEPS = 2.0, 64
_GEN_TOKENS = (2, 16)  # forced new tokens of the two timed generate calls (prefill vs decode)


def main() -> None:
    """One rank of the measurement (``python -m workbench.train.steprank``, its job in the
    environment): one JSON line of its figures, last on stdout."""
    import os

    from workbench.train.preload import collector_off, import_training_libraries, imports_done

    # What a rank imports before its first step, the way a rank imports it, timed as its start.
    collector_off()
    import_training_libraries()
    imports_done()
    import torch

    import_s = time.time() - float(os.environ["WB_STEPCLOCK_T0"])
    base = _status_gib("VmRSS")  # a rank's resident memory once it has imported, before a model
    job = json.loads(os.environ["WB_STEPCLOCK_JOB"])
    from workbench.spec import RunSpec

    spec = RunSpec.coerce(job["spec"])
    run_dir = _scratch_run_dir(spec, Path(job["scratch"]) / f"rank-{os.environ['RANK']}")
    # The Trainer joins the ranks' process group itself (gloo on CPU), as in the run.
    fits = [(n, *_measure_layers(spec, job, n, run_dir)) for n in job["fit_layers"]]
    (l1, w1, f1, p1, d1, n1, m1), (l2, w2, f2, p2, d2, n2, m2) = fits
    n = job["layers"]

    def at_n(one: float, two: float, floor: float = 0.0) -> float:
        # a + b x layers through the two, b at least ``floor``, never below one
        return max(one, one + max(floor, two - one) * (n - l1) / (l2 - l1))

    whole = at_n(w1, w2)
    fwd_bwd = min(whole, at_n(f1, f2))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
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
                      # big vocabulary, under the noise, and a clamped 0 would leave out every
                      # layer.
                      "gen_token_s": at_n(d1, d2, d1 * max(0, n2 - n1) / max(1, n1)),
                      "metrics_s": metrics_s,
                      # None where the peak cannot be read (a GPU rank's is its allocator's;
                      # not Linux)
                      "peak_gib": base + at_n(m1, m2) if base and m1 and m2 else None}),
          flush=True)


def _measure_layers(spec: Any, job: dict[str, Any], layers: int, run_dir: Path
                    ) -> tuple[float, float, float, float, int, float | None]:
    """(step, forward + backward, generate's prefill, its per-token decode (rank 0's; 0 on the
    others), the weights, the rank's peak resident GiB while it trained and generated) of the
    model cut to ``layers``."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from workbench.plan.shape import _config_for

    cfg, _ = _config_for(spec.model.id, spec.model.revision, spec.model.trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:layers]
    on_gpu = bool(job["on_gpu"])
    before = _reset_peak()
    torch.manual_seed(0)
    # The attention kernel the run's load_model asks for (workbench.train.fastpath), so the
    # packed batch is attended as in the run (sdpa's block mask, or flash's varlen).
    model: Any = AutoModelForCausalLM.from_config(
        cfg, dtype=getattr(torch, job["load_dtype"]),
        trust_remote_code=spec.model.trust_remote_code,
        **_attention_kwargs(spec, cfg, job["load_dtype"]))
    if spec.method.kind in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(  # as the run's load_model adapts it
            r=spec.method.lora_r, lora_alpha=spec.method.lora_alpha,
            lora_dropout=spec.method.lora_dropout, target_modules=spec.method.target_modules,
            task_type="CAUSAL_LM"), autocast_adapter_dtype=True)
    # The run's own training step: its Trainer, arguments, collator and callbacks.
    step = time_train_steps(model, run_dir, job["seq"], job["vocab"], on_gpu)
    dev = next(model.parameters()).device  # where the Trainer put it
    ids = torch.randint(0, max(2, job["vocab"]), (spec.train.batch_size, job["seq"]), device=dev)
    ctx = (torch.autocast("cuda", dtype=getattr(torch, job["dtype"]))
           if on_gpu and job["dtype"] != job["load_dtype"] else _null())
    # After the steps, as the run scores after its steps, and on rank 0 alone, as the run
    # scores, the others waiting: a decode step is bound by memory bandwidth, which two CPU ranks
    # decoding at once share (timing every rank at once plans the scoring long).
    alone = int(os.environ.get("RANK", "0")) == 0
    generate = _time_generate(model, ids, ctx, on_gpu) if alone else (0.0, 0.0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    weights = sum(p.numel() for p in model.parameters())
    peak = _status_gib("VmHWM")
    # What this layer count added to the rank's resident memory at its peak: what an earlier
    # layer count left behind is not its own.
    grew = None if on_gpu or before is None or peak is None else peak - before
    return (*step, *generate, weights, grew)


def _reset_peak() -> float | None:
    """Start this process's peak resident memory afresh (Linux: /proc/self/clear_refs), after
    handing the last layer count's freed memory back; its resident GiB now (None where /proc
    cannot say)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what is freed stays counted, a little over
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_gib("VmRSS")


def _status_gib(field: str) -> float | None:
    """/proc/self/status's ``field`` (VmRSS: resident now; VmHWM: its peak since the last
    reset) in GiB; None where /proc cannot say (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


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


def _scratch_run_dir(spec: Any, path: Path) -> Path:
    """A run directory of this rank's own at ``path`` for the measurement of ``spec``'s step:
    the spec with the changes the module docstring lists, and a plan.json choosing DDP."""
    from workbench.runs.rundir import RunDir
    from workbench.spec import RunSpec

    raw = spec.model_dump(mode="json")
    raw["train"].update(max_steps=_MAX_STEPS, grad_accum=1, eval_every=0)
    raw["parallel"] = {**raw.get("parallel", {}), "strategy": "auto"}
    rd = RunDir(path).create(RunSpec.coerce(raw))
    rd.plan_file.write_text(json.dumps({"strategy": {
        "parallel": "ddp", "offload_optimizer": False, "offload_params": False}}))
    return rd.path


def time_train_steps(model: Any, run_dir: Path, seq: int, vocab: int, on_gpu: bool
                     ) -> tuple[float, float]:
    """(the whole step, of which forward + backward of the micro-batch) median seconds of the
    run's Trainer training ``model`` on micro-batches of random ``seq``-token rows, laid out by
    the run's collator: the order :func:`_measure_layers` returns them in. Every rank calls it at
    once (the Trainer joins them in its process group)."""
    import os
    import statistics

    import datasets
    import torch
    from transformers import TrainerCallback

    from workbench.data.batches import Collator
    from workbench.runs.budget import Billing
    from workbench.runs.rundir import RunDir
    from workbench.train.arguments import training_arguments
    from workbench.train.callbacks import RunDirCallback, SnapshotCallback
    from workbench.train.snapshotting import snapshotting_trainer_class

    rd = RunDir(run_dir)
    spec = rd.spec()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = spec.train.max_steps or _MAX_STEPS
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    ids = torch.randint(0, max(2, vocab), (spec.train.batch_size * steps * world, seq),
                        generator=g).tolist()
    rows: dict[str, list[Any]] = {"input_ids": ids, "labels": ids}
    if spec.data.packing:  # one example per row: where examples start does not change the cost
        rows["position_ids"] = [list(range(seq))] * len(ids)
    # Arrow-backed, as the run's dataset is; the lists would stay in the measured peak memory.
    dataset = datasets.Dataset.from_dict(rows)
    del rows, ids
    billing = Billing(spec, rd.status())
    snapshots = SnapshotCallback(spec, billing)
    # Their per-step checks (and the collective agreeing on them) run; they never fire here.
    billing.limit = None if billing.limit is None else float("inf")
    snapshots.every_steps = None
    snapshots.every_s = None if snapshots.every_s is None else float("inf")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.began = 0.0
            self.ends: list[float] = []
            self.fwd_bwd: list[float] = []

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.began = time.perf_counter()

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            sync()  # forward, backward (DDP's all-reduce in it) and the gradient clip
            self.fwd_bwd.append(time.perf_counter() - self.began)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            self.ends.append(time.perf_counter())
            if len(self.ends) - 1 - _WARM < _CALLS:
                return
            # Enough timed: every rank must stop at the same step (DDP's collectives), so they
            # agree, at the same steps on every rank, on the one that has timed the least.
            enough = torch.tensor([float(self.ends[-1] - self.ends[_WARM] >= _MIN_TIMED_S)],
                                  device=f"cuda:{torch.cuda.current_device()}" if on_gpu
                                  else "cpu")
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(enough, op=torch.distributed.ReduceOp.MIN)
            if enough.item() > 0:
                control.should_training_stop = True

    clock = Clock()
    args = training_arguments(spec, rd, has_eval=False)
    trainer = snapshotting_trainer_class()(
        model=model, args=args, train_dataset=dataset,
        data_collator=Collator(pad_token_id=0),
        callbacks=[RunDirCallback(rd, world), snapshots, clock], run_dir=rd, keep=1)
    trainer.train()
    # An interval between step ends holds one whole step: the next batch's loading, forward,
    # backward, optimizer, and the logging and callbacks after the step before.
    whole = [b - a for a, b in zip(clock.ends[_WARM:], clock.ends[_WARM + 1:], strict=False)]
    if not whole:
        raise RuntimeError(f"the Trainer took {len(clock.ends)} of {steps} steps")
    step = statistics.median(whole)
    return step, min(step, statistics.median(clock.fwd_bwd[_WARM + 1:]))


if __name__ == "__main__":
    main()
