"""One GPU check (issue 16): LoRA throughput and MFU with and without packing, peak memory
against the planner, snapshot stall against a synchronous save, and LoRA tokens/s with and
without Liger's kernels side by side (alternating rounds), written to one JSON; then, in a
process of its own, the published reference runs that fit the card (bench/gpu_published.py,
issue 40: planned, measured and published side by side, in a JSON of its own).

    make gpu-check                          # on one modern GPU: a 7B-shaped Llama, <= 8 minutes,
                                            # then the published rows, ~3 minutes (<= 7)
    python bench/gpu_check.py --smoke       # anywhere (CPU): a tiny Llama, seconds; the test
                                            # suite runs this so the check cannot rot
    python bench/gpu_check.py --no-published  # without the published rows

Nothing is downloaded: the model is built from Llama-2-7B's config (shipped with the planner)
with random weights, directly on the device, and the data is synthetic token ids of varied
lengths. Precision is what the trainer would use (workbench.spec.precision): bf16 frozen base, fp32
adapters and AdamW, bf16 autocast on a bf16 GPU. "Packed" is the concatenation workbench packs
today (examples share one causal mask; position-id packing is issue 16 item 4).

MFU counts 4·N FLOPs per trained token (forward 2N + input gradients 2N; the frozen base has no
weight gradients) against the card's dense bf16 peak from the GPU table; attention's own FLOPs are
left out, so it is a lower bound. Peak memory on a GPU is what the device reports in use (torch's
reserved memory plus the CUDA context), against the planner's per-GPU total; on CPU it is the
process's peak RSS while it trains (the peak is reset after planning: the planner's own work, a
fresh home's calibration and first step, is not a training process's) against the planner's
per-process host RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # GPU machines often have no network: never ask

from workbench.plan import GiB, plan  # noqa: E402
from workbench.spec import RunSpec  # noqa: E402
from workbench.spec.precision import local_device_kind, resolve_precision  # noqa: E402
from workbench.targets.gpus import detect_gpu_type, get_gpu  # noqa: E402
from workbench.train.steprank import _reset_peak, _status_gib  # noqa: E402

FULL = {"model": "meta-llama/Llama-2-7b-hf", "batch": 4, "seq": 1024, "steps": 8, "warmup": 2,
        "examples": 256, "min_len": 64, "rounds": 4}
SMOKE = {"model": "builtin:tiny-llama", "batch": 2, "seq": 64, "steps": 3, "warmup": 1,
         "examples": 24, "min_len": 8, "rounds": 2}


def _spec(cfg: dict[str, Any], on_gpu: bool, gpu_type: str | None) -> RunSpec:
    return RunSpec.parse({
        "model": {"id": cfg["model"]}, "method": {"kind": "lora", "lora_r": 16},
        "train": {"batch_size": cfg["batch"], "gradient_checkpointing": False,
                  "max_steps": cfg["steps"]},
        "data": {"max_length": cfg["seq"], "packing": False},
        "resources": {"gpus_per_node": 1 if on_gpu else 0, "processes_per_node": 1,
                      "gpu_type": gpu_type},
        "parallel": {"strategy": "ddp"},
    })


def build_model(model_id: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Random weights in the model's shape, made on the device (no download, no CPU copy)."""
    from transformers import AutoModelForCausalLM

    from workbench.plan.shape import _config_for

    cfg, _ = _config_for(model_id, None, False)
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def synthetic_examples(n: int, min_len: int, max_len: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g) for k in lengths]


def batches(examples: list[torch.Tensor], batch: int, seq: int, packed: bool) -> list[tuple]:
    """(input_ids, labels, attention_mask, real tokens) per batch: padded, or concatenated."""
    out = []
    if packed:
        flat = torch.cat(examples)
        rows = flat[: len(flat) // seq * seq].view(-1, seq)
        for i in range(0, len(rows) - batch + 1, batch):
            ids = rows[i:i + batch]
            out.append((ids, ids.clone(), torch.ones_like(ids), ids.numel()))
        return out
    for i in range(0, len(examples) - batch + 1, batch):
        chunk = examples[i:i + batch]
        width = max(len(e) for e in chunk)
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(chunk):
            ids[r, :len(e)] = e
            mask[r, :len(e)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, labels, mask, int(mask.sum())))
    return out


def train_lora(model: Any, data: list[tuple], steps: int, warmup: int, amp: str,
               device: torch.device) -> tuple[float, Any, Any]:
    """Tokens/s of LoRA steps over ``data`` (cycled), after ``warmup`` steps not timed."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    tokens, t0 = 0, 0.0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            tokens, t0 = 0, time.perf_counter()
        ids, labels, mask, real = (x.to(device) if torch.is_tensor(x) else x
                                   for x in data[i % len(data)])
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=labels, attention_mask=mask).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += real
    _sync(device)
    return tokens / (time.perf_counter() - t0), opt, loss


def alternate(variants: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Tokens/s of each variant (a callable returning tokens/s), measured side by side: ``rounds``
    rounds, the order reversed every round so neither variant always runs first (warm caches,
    clocks, a neighbour's load hit both alike). The median of each variant's rounds, and every
    round, in the order they ran."""
    names = list(variants)
    runs: dict[str, list[float]] = {n: [] for n in names}
    order: list[str] = []
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(variants[name]())
            order.append(name)
    return {"rounds": rounds, "order": order, "tokens_per_s": runs,
            "median_tokens_per_s": {n: statistics.median(v) for n, v in runs.items()}}


def liger_side_by_side(model_id: str, device: torch.device, dtype: torch.dtype,
                       data: list[tuple], cfg: dict[str, Any], amp: str) -> dict[str, Any]:
    """LoRA tokens/s with and without Liger's kernels (RMSNorm, SwiGLU, RoPE, fused linear
    cross-entropy) on two copies of the same random model, alternating; or why it was skipped."""
    import importlib.util

    if device.type != "cuda":
        return {"skipped": "Liger's Triton kernels need a CUDA GPU"}
    if importlib.util.find_spec("liger_kernel") is None:
        return {"skipped": "liger-kernel is not installed (make gpu-wheels, or "
                           "pip install 'workbench[gpu]')"}
    import gc

    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from peft import LoraConfig, get_peft_model

    gc.collect()  # the first measurement's model, before two more copies are built
    torch.cuda.empty_cache()
    models = {}
    for name in ("plain", "liger"):
        base = build_model(model_id, device, dtype)
        if name == "liger":
            _apply_liger_kernel_to_instance(model=base)  # patches this instance only
        m = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        m.train()
        models[name] = m

    def run(name: str) -> Any:
        return lambda: train_lora(models[name], data, cfg["steps"], cfg["warmup"], amp, device)[0]

    result = alternate({n: run(n) for n in models}, cfg["rounds"])
    med = result["median_tokens_per_s"]
    result["liger_over_plain"] = med["liger"] / med["plain"]
    models.clear()  # free both copies before the caller goes on
    torch.cuda.empty_cache()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def snapshot_stall(model: Any, opt: Any, data: list[tuple], device: torch.device,
                   folder: Path) -> dict[str, float]:
    """Training's stall for an asynchronous snapshot (workbench's AsyncWriter: the copy, and the
    next optimizer step's wait for it) against a synchronous torch.save of the same state."""
    from workbench.train.async_snapshot import AsyncWriter

    state = {"model": {k: v for k, v in model.state_dict().items() if "lora_" in k},
             "optimizer": opt.state_dict()}
    t0 = time.perf_counter()
    torch.save(state, folder / "sync.pt")
    os.sync()
    sync_s = time.perf_counter() - t0
    writer = AsyncWriter(0)
    snap = folder / "async"
    snap.mkdir()
    t0 = time.perf_counter()
    with writer.capture():
        torch.save(state, snap / "state.pt")
    writer.flush_async(snap)
    plan_s = time.perf_counter() - t0
    ids, labels, mask, _ = (x.to(device) if torch.is_tensor(x) else x for x in data[0])
    model(input_ids=ids, labels=labels, attention_mask=mask).loss.backward()
    opt.step()  # holds until the writer has copied the state it changes
    opt.zero_grad(set_to_none=True)
    writer.wait()
    copies = writer.current
    stall_s = copies.stall_s if copies is not None else plan_s
    return {"sync_save_s": sync_s, "stall_s": stall_s,
            "stall_over_sync": stall_s / sync_s if sync_s else float("nan"),
            "state_bytes": (folder / "sync.pt").stat().st_size,
            "async_equals_sync": _same(folder / "sync.pt", snap / "state.pt")}


def _same(a: Path, b: Path) -> bool:
    """The two files hold the same model tensors (the optimizer moved on in between)."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x["model"].keys() == y["model"].keys() and all(
        torch.equal(x["model"][k], y["model"][k]) for k in x["model"])


def published_rows(smoke: bool, folder: Path | None) -> dict[str, Any]:
    """bench/gpu_published.py in a process of its own (its memory readings start from a clean
    card): where it wrote its JSON, its exit status and its one line per row."""
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_published.py"))]
    if smoke:
        cmd.append("--cpu-dry-run")
    if folder is not None:  # beside gpu_check's own JSON
        cmd += ["--out", str(folder / f"gpu_published-{'dry-run' if smoke else 'gpu'}.json")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout, end="", flush=True)
    lines = done.stdout.splitlines()
    wrote = next((ln[len("wrote "):] for ln in lines if ln.startswith("wrote ")), None)
    return {"json": wrote, "rc": done.returncode,
            "rows": [ln for ln in lines if not ln.startswith("wrote ")],
            "stderr_tail": done.stderr[-2000:] if done.returncode else ""}


def launched_run(on_gpu: bool) -> dict[str, Any]:
    """The built-in tiny run launched the ordinary way (a standby start, then the go) on one
    card: it must succeed, and its bill must start no earlier than its run directory (the cards
    are leased at the go, after launch planned and prepared the data)."""
    import workbench

    before = os.environ.get("WORKBENCH_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["WORKBENCH_HOME"] = home
        try:
            resources = {"gpus_per_node": 1} if on_gpu else {"processes_per_node": 1}
            job = workbench.launch({"name": "gpu-check", "resources": resources,
                                    "train": {"max_steps": 20}})
            state = job.wait(timeout=900)
            status = job.status()
        finally:  # the checks after this one use the home they were given
            if before is None:
                os.environ.pop("WORKBENCH_HOME", None)
            else:
                os.environ["WORKBENCH_HOME"] = before
    ok = state == "succeeded" and status["attempt_started"] >= status["created"] - 0.01
    return {"state": state, "created": status["created"],
            "attempt_started": status["attempt_started"], "billed_s": status.get("billed_s"),
            "bill_from_the_lease": ok if on_gpu else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU in seconds")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/gpu_check-*.json)")
    ap.add_argument("--no-published", action="store_true",
                    help="leave out the published reference runs (bench/gpu_published.py)")
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        raise SystemExit("gpu_check needs a CUDA GPU (or --smoke); nothing measured")
    device = torch.device("cuda" if on_gpu else "cpu")
    gpu_type = detect_gpu_type() if on_gpu else "CPU"
    if on_gpu and gpu_type is None:
        raise SystemExit(f"unknown card {torch.cuda.get_device_name(0)!r}: add it to "
                         "$WORKBENCH_HOME/gpus.yaml (memory_gib, bf16_tflops)")
    card = get_gpu(gpu_type or "CPU")
    peak_tflops = card.bf16_tflops * (1 if on_gpu else torch.get_num_threads())
    precision = resolve_precision("auto", "lora", local_device_kind())
    predicted = plan(_spec(cfg, on_gpu, gpu_type if on_gpu else None))
    planner_peak = _status_gib("VmHWM")
    peak_reset = _reset_peak() is not None  # what follows is the training's own peak

    from peft import LoraConfig, get_peft_model

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg["model"], device, getattr(torch, precision.load_dtype))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    examples = synthetic_examples(cfg["examples"], cfg["min_len"], cfg["seq"],
                                  model.config.vocab_size)
    result: dict[str, Any] = {
        "smoke": args.smoke, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "gpu_type": gpu_type, "model_shape": cfg["model"], "params": params,
        "torch": torch.__version__, "python": platform.python_version(),
        "precision": {"load": precision.load_dtype, "amp": precision.amp,
                      "reason": precision.reason},
        "batch": cfg["batch"], "seq": cfg["seq"], "lora": {},
    }
    opt = None
    for packed in (False, True):
        data = batches(examples, cfg["batch"], cfg["seq"], packed)
        tps, opt, loss = train_lora(model, data, cfg["steps"], cfg["warmup"], precision.amp,
                                    device)
        result["lora"]["packed" if packed else "padded"] = {
            "tokens_per_s": tps, "mfu": tps * 4 * params / (peak_tflops * 1e12),
            "last_loss": loss.item()}
    if on_gpu:
        free, total = torch.cuda.mem_get_info()
        measured = (total - free) / GiB
        what = "device memory in use (reserved + CUDA context)"
    else:
        measured = (_status_gib("VmHWM") if peak_reset else None) or (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB)
        what = "process peak RSS while training" if peak_reset else "process peak RSS"
    result["memory"] = {"measured_gib": measured, "measured": what,
                        "planner_peak_rss_gib": planner_peak,
                        "planned_gib": predicted.memory.total,
                        "planned_over_measured": predicted.memory.total / measured}
    with tempfile.TemporaryDirectory() as tmp:
        result["snapshot"] = snapshot_stall(model, opt, data, device, Path(tmp))
    del model, opt
    # Packed rows: every token is real, so the two variants train on exactly the same work.
    result["liger"] = liger_side_by_side(cfg["model"], device,
                                         getattr(torch, precision.load_dtype), data, cfg,
                                         precision.amp)
    result["launched"] = launched_run(on_gpu)
    if not args.no_published:
        if on_gpu:  # the card as free as this process can leave it for the other one
            torch.cuda.empty_cache()
        result["published"] = published_rows(args.smoke, args.out.parent if args.out else None)
    out = args.out or Path(__file__).parent / "results" / (
        f"gpu_check-{'smoke' if args.smoke else gpu_type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lora = result["lora"]
    print(f"{gpu_type}: LoRA {lora['padded']['tokens_per_s']:.0f} tok/s padded, "
          f"{lora['packed']['tokens_per_s']:.0f} packed (MFU {lora['packed']['mfu']:.1%}); "
          f"memory planned {predicted.memory.total:.2f} / measured {measured:.2f} GiB; "
          f"snapshot stall {result['snapshot']['stall_over_sync']:.2f} x a sync save; "
          + (f"liger {result['liger']['liger_over_plain']:.2f} x plain; "
             if "liger_over_plain" in result["liger"] else
             f"liger skipped ({result['liger']['skipped']}); ") +
          f"wrote {out}", flush=True)
    return result.get("published", {}).get("rc", 0)


if __name__ == "__main__":
    raise SystemExit(main())
