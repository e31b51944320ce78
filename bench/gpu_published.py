"""The published reference runs on a lent GPU (issue 40): each one-node row of
workbench.plan.published whose setup the plan says fits this card is run the way the trainer runs
it, and planned, measured and published are recorded side by side.

    python bench/gpu_published.py                 # on one CUDA GPU; bench/gpu_check.py calls it
    python bench/gpu_published.py --cpu-dry-run   # the same code on CPU with a tiny model, seconds

A row is its source's setup (``Reference.stated_spec``: batch 2 x 2,048 tokens, its method,
rank, checkpointing and optimizer) planned for this card. Rows needing more than this machine's
cards, that the plan says do not fit, or that this card or install cannot run (bf16 weights
without bf16, bitsandbytes missing) are skipped with the reason.

The model is built on the card in bf16 from the planner's offline config with random weights (no
hub; memory and speed are those of trained weights) and prepared as workbench.train.model and the
Trainer prepare it: QLoRA's linears (not lm_head) in bitsandbytes' NF4 with double quantisation,
non-reentrant gradient checkpointing, peft LoRA with fp32 adapters, the fast paths
workbench.train.fastpath resolves here (Liger through transformers' ``apply_liger_kernel``,
attention), the Trainer's optimizer class for that ``optim``, stepped in backward
(workbench.train.in_backward) for the full rows. The loop is gpu_plan_check's (random token rows,
the model's own loss, bf16 autocast), not the Trainer: launching would need the random 8B model
saved to disk (16 GB) and a tokenizer, for a data pipeline that adds little per step.

Memory: torch's peak allocated and reserved (what the published peaks count), and the device's
memory in use (what nvidia-smi shows, with the pages of a paged optimizer's states the driver
holds on the card) sampled every 0.2 s, as its rise over the row's start plus this process's CUDA
context (bitsandbytes never frees paged states: a full row's stay in the next rows' start). JSON:
bench/results/gpu_published-<gpu>.json; one line per row on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # GPU machines often have no network: never ask

from workbench.errors import WorkbenchError  # noqa: E402
from workbench.plan import GiB, Plan, plan  # noqa: E402
from workbench.plan.published import REFERENCES, Reference  # noqa: E402
from workbench.spec import RunSpec  # noqa: E402
from workbench.spec.precision import Precision, local_device_kind, resolve_precision  # noqa: E402
from workbench.targets.gpus import detect_gpu_type  # noqa: E402
from workbench.train.fastpath import Device, FastPaths, local_device, resolve_fast_paths  # noqa: E402

CUDA_CONTEXT_GIB = 0.9  # in the plan's total, not in torch's counters (tests/test_plan_published)
# Per row: 3 untimed steps (Triton's first compiles), then 20 timed or 60 s of them; no row
# starts once the check has run 300 s.
GPU = {"steps": 20, "warmup": 3, "row_s": 60.0, "budget_s": 300.0}
# The dry run: the tiny built-in Llama on short rows, the rows still planned as published.
DRY = {"steps": 2, "warmup": 1, "row_s": 30.0, "budget_s": 120.0,
       "model": "builtin:tiny-llama", "seq": 64, "gpu_type": "RTX 4090"}


def choose(rows: list[Reference], gpu_type: str, cards: int
           ) -> list[tuple[Reference, RunSpec | None, Plan | None, str | None]]:
    """(row, its spec on ``gpu_type``, the plan, None) for each row to measure, or
    (row, spec or None, plan or None, why it is skipped)."""
    out: list[tuple[Reference, RunSpec | None, Plan | None, str | None]] = []
    for row in rows:
        if row.gpus > cards:
            out.append((row, None, None, f"needs {row.gpus} GPUs on one node; this machine "
                                         f"lends {cards}"))
            continue
        try:
            spec = row.stated_spec(gpu_type)
            p = plan(spec)
        except WorkbenchError as e:
            out.append((row, None, None, f"the setup cannot run on a {gpu_type}: {e}"))
            continue
        why = None if p.fits else (f"the plan does not fit a {gpu_type}: {p.memory.total:.1f} "
                                   f"GiB of {p.capacity_gib:.1f}")
        out.append((row, spec, p, why))
    return out


def planned(p: Plan) -> dict[str, Any]:
    """The plan's figures for the lent card."""
    step_s = (p.clock or {}).get("step_s")
    return {"strategy": p.strategy.label, "peak_gib": p.memory.total,
            "peak_torch_gib": p.memory.total - CUDA_CONTEXT_GIB, "paged_gib": p.memory.paged,
            "tokens_per_step": p.tokens_per_step, "step_s": step_s,
            "tokens_per_s": p.tokens_per_step / step_s if step_s else None,
            "memory_gib": p.memory.to_dict(), "clock": p.clock}


def published(row: Reference, gpu_type: str) -> dict[str, Any]:
    note = None if row.gpu == gpu_type else f"published on a {row.gpu}: the card differs"
    return {"gpu": row.gpu, "gpus": row.gpus, "peak_gib": row.peak_gib,
            "tokens_per_s": row.tokens_per_s, "source": row.source, "note": note}


def cuda_context_gib(device: torch.device) -> float | None:
    """This process's CUDA context: nvidia-smi's memory in use on its card before and after
    torch starts CUDA here (another process's is not counted); None without nvidia-smi."""
    import subprocess

    card = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", card]
    try:
        before = float(subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout)
        torch.empty(1, device=device)
        after = float(subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        torch.empty(1, device=device)
        return None
    return max(after - before, 0.0) / 1024


def _device_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GiB


class _UsedPeak:
    """The device's memory in use, sampled every ``every`` s in a thread: its peak."""

    def __init__(self, every: float = 0.2) -> None:
        self.peak, self._every, self._stop = _device_used(), every, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, _device_used())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _device_used())


def _quantize_nf4(model: Any, compute_dtype: torch.dtype) -> None:
    """Every linear layer but lm_head as bitsandbytes' Linear4bit, NF4 with double quantisation
    (workbench.train.model's BitsAndBytesConfig), quantised where its weight lies. Each bf16
    weight is freed once replaced, but the whole bf16 model is built first (16 GB for 8B)."""
    import bitsandbytes as bnb

    for parent in [m for m in model.modules() if not isinstance(m, torch.nn.Linear)]:
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                  bias=child.bias is not None, compute_dtype=compute_dtype,
                                  compress_statistics=True, quant_type="nf4", device="meta")
            weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                       compress_statistics=True, quant_type="nf4", module=q)
            q.weight = weight.to(child.weight.device)  # quantises it
            if child.bias is not None:
                q.bias = child.bias
            setattr(parent, name, q)
            del child, weight
    model.is_loaded_in_4bit = True  # what peft reads to put LoRA on Linear4bit


def build(spec: RunSpec, model_id: str, device: torch.device, precision: Precision,
          fast: FastPaths, quantize: bool) -> Any:
    """The model as the trainer prepares it (see the module's docstring), on ``device``."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.integrations.liger import apply_liger_kernel

    from workbench.plan.shape import _config_for

    cfg, _ = _config_for(model_id, None, False)
    torch.manual_seed(0)
    with device:
        model: Any = AutoModelForCausalLM.from_config(
            cfg, dtype=getattr(torch, precision.load_dtype), **fast.model_kwargs())
    kind, gc_on = spec.method.kind, spec.train.gradient_checkpointing
    gc_kwargs = {"use_reentrant": False}
    if kind == "qlora":
        if quantize:
            _quantize_nf4(model, getattr(torch, precision.compute_dtype))
            torch.cuda.empty_cache()  # the bf16 weights just replaced
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc_on,
                                                gradient_checkpointing_kwargs=gc_kwargs)
    if gc_on:  # peft enables it only on a quantised model: here on every one alike
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
        if kind != "full":
            model.enable_input_require_grads()  # the frozen embedding's output needs grad
    if kind in ("lora", "qlora"):
        m = spec.method
        model = get_peft_model(model, LoraConfig(
            r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
            target_modules=m.target_modules, task_type="CAUSAL_LM"), autocast_adapter_dtype=True)
    if fast.liger:
        apply_liger_kernel(model, fast.liger_config)
    model.config.use_cache = False
    model.train()
    return model


def optimizer(model: Any, spec: RunSpec, fast: FastPaths, in_backward: bool) -> Any:
    """The Trainer's optimizer class and arguments for ``fast.optim``; per parameter, stepped in
    backward, where ``in_backward``."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from workbench.train.in_backward import InBackwardOptimizer

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=fast.optim, learning_rate=spec.train.lr,
                                 weight_decay=spec.train.weight_decay, report_to=[],
                                 use_cpu=not torch.cuda.is_available())
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if in_backward:
        return InBackwardOptimizer(model, cls, kwargs, set(), 0.0)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def steps(model: Any, opt: Any, ids: torch.Tensor, amp: str, device: torch.device,
          cfg: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of up to ``cfg['steps']`` steps after ``cfg['warmup']`` untimed ones, stopped
    once ``cfg['row_s']`` seconds of timed steps have passed."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    done, t0, loss = 0, 0.0, None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"]:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= cfg["warmup"]:
            done += 1
            if time.perf_counter() - t0 > cfg["row_s"]:
                break
    seconds = time.perf_counter() - t0
    return {"steps": done, "warmup": cfg["warmup"], "seconds": seconds,
            "tokens_per_s": done * ids.numel() / seconds,
            "last_loss": None if loss is None else float(loss.item())}


def measure(spec: RunSpec, device: torch.device, cfg: dict[str, Any], dry: bool,
            context_gib: float | None) -> dict[str, Any]:
    """One row: its model built, ``cfg['steps']`` steps timed, its memory read (see the
    module's docstring). ``dry``: on CPU, the tiny model, with what needs CUDA left out."""
    notes: list[str] = []
    quantize = spec.model.quantization == "4bit"
    model_id, seq = spec.model.id, spec.data.max_length
    in_backward = spec.train.optimizer_in_backward is True
    optim_wanted, master = spec.train.optimizer, spec.train.master_weights
    if dry:
        model_id, seq = cfg["model"], cfg["seq"]
        if quantize:
            notes.append("dry run: 4-bit quantisation left out (CUDA and bitsandbytes)")
            quantize = False
        if optim_wanted != "adamw":
            notes.append(f"dry run: torch AdamW for {optim_wanted} (bitsandbytes needs CUDA)")
            optim_wanted = "adamw"
        if master == "none":
            notes.append("dry run: fp32 weights (pure bf16 weights need a bf16 GPU)")
            master = "auto"
    kind = "cpu" if dry else local_device_kind()
    precision = resolve_precision(spec.model.dtype, spec.method.kind, kind,
                                  in_backward=in_backward, master_weights=master)
    here = Device(cuda=False) if dry else local_device()
    fast = resolve_fast_paths(spec.train.fast, here, "llama", precision.load_dtype,
                              optimizer=optim_wanted)
    if fast.tf32 is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = fast.tf32
    t0 = time.perf_counter()
    on_cuda = device.type == "cuda"
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        before = _device_used()
    model = build(spec, model_id, device, precision, fast, quantize)
    opt = optimizer(model, spec, fast, in_backward)
    build_s = time.perf_counter() - t0
    if on_cuda:  # from here, as loading leaves it (QLoRA's bf16 weights were quantised away)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        used = _UsedPeak()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (spec.train.batch_size, seq),
                        generator=g).to(device)
    try:
        timing = steps(model, opt, ids, precision.amp, device, cfg)
    finally:
        peak = used.stop() if on_cuda else 0.0
    memory: dict[str, Any] = {"max_allocated_gib": None, "max_reserved_gib": None,
                              "device_used_gib": None}
    if on_cuda:
        memory = {"max_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
                  "max_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
                  "device_used_gib": peak - before + (context_gib or 0.0),
                  "device_used_peak_gib": peak, "device_used_before_gib": before}
    else:
        memory["process_peak_rss_gib"] = resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    getattr(opt, "remove_hooks", lambda: None)()  # the optimizer in backward's hooks
    del model, opt, ids
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return {"model": model_id, "seq": seq, "build_s": build_s, **timing, "memory": memory,
            "precision": {"load": precision.load_dtype, "amp": precision.amp},
            "fast_paths": fast.line(), "fast_path_notes": list(fast.notes), "notes": notes}


def _row_line(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"{r['name']}: skipped ({r['skipped']})"
    if "error" in r:
        return f"{r['name']}: FAILED ({r['error']})"
    p, m, pub = r["planned"], r["measured"], r["published"]
    mem = m["memory"]
    torch_peak = (f"{mem['max_allocated_gib']:.1f} alloc / {mem['max_reserved_gib']:.1f} "
                  f"reserved / {mem['device_used_gib']:.1f} in use GiB"
                  if mem.get("max_reserved_gib") is not None else
                  f"{mem['process_peak_rss_gib']:.2f} GiB peak RSS")
    planned_tps = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] else "?"
    return (f"{r['name']}: planned {p['peak_torch_gib']:.1f} GiB torch ({p['peak_gib']:.1f} "
            f"total), {planned_tps} tok/s | measured {torch_peak}, "
            f"{m['tokens_per_s']:,.0f} tok/s over {m['steps']} steps | published "
            f"{pub['peak_gib']} GiB, {pub['tokens_per_s']:,.0f} tok/s on {pub['gpus']}x "
            f"{pub['gpu']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="on CPU, the tiny model through the same code; seconds")
    ap.add_argument("--gpu-type", help="the card to plan for (default: detected; dry run: "
                                       f"{DRY['gpu_type']})")
    ap.add_argument("--steps", type=int, help="timed steps per row")
    ap.add_argument("--budget-s", type=float, help="rows not started by then are skipped")
    ap.add_argument("--out", type=Path, help="JSON path (default "
                                             "bench/results/gpu_published-<gpu>.json)")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    cfg = dict(DRY if dry else GPU)
    cfg.update({k: v for k, v in (("steps", args.steps), ("budget_s", args.budget_s))
                if v is not None})
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_published needs a CUDA GPU (or --cpu-dry-run); nothing measured")
    device = torch.device("cpu" if dry else "cuda")
    context = None if dry else cuda_context_gib(device)  # before anything else here uses CUDA
    gpu_type = args.gpu_type or (DRY["gpu_type"] if dry else detect_gpu_type())
    if gpu_type is None:
        raise SystemExit(f"unknown card {torch.cuda.get_device_name(0)!r}: pass --gpu-type or "
                         "add it to $WORKBENCH_HOME/gpus.yaml (memory_gib, bf16_tflops)")
    cards = 1 if dry else torch.cuda.device_count()
    start, rows = time.perf_counter(), []
    for row, spec, p, why in choose(REFERENCES, gpu_type, cards):
        r: dict[str, Any] = {"name": row.name, "published": published(row, gpu_type)}
        if p is not None:
            r["planned"] = planned(p)
        if why is None and time.perf_counter() - start > cfg["budget_s"]:
            why = f"the check's time box ({cfg['budget_s']:.0f} s) was spent before this row"
        if why is None and spec is not None:
            try:
                r["measured"] = measure(spec, device, cfg, dry, context)
            except (WorkbenchError, ImportError) as e:  # a fast path this install cannot run
                why = f"this install cannot run the setup: {e}"
            except Exception as e:  # out of memory, an API that changed: the next rows still run
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc()[-4000:]
            finally:
                gc.collect()  # the failed row's model, once its frames are gone
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if why is not None:
            r["skipped"] = why
        rows.append(r)
        print(_row_line(r), flush=True)
    result = {"dry_run": dry, "device": "cpu" if dry else torch.cuda.get_device_name(0),
              "gpu_type": gpu_type, "cards": cards, "context_gib": context,
              "torch": torch.__version__, "python": platform.python_version(),
              "steps": cfg["steps"], "warmup": cfg["warmup"], "seconds": 0.0, "rows": rows}
    result["seconds"] = time.perf_counter() - start
    out = args.out or Path(__file__).parent / "results" / (
        f"gpu_published-{'dry-run' if dry else gpu_type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
