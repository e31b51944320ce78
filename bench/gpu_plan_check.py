"""GPU check of the planner: measure the peak memory of real LoRA steps and compare with the plan.

Run on a machine with one CUDA GPU (no hub access needed: a hub id whose config the planner knows
offline is built from that config with random weights, which use exactly the memory trained
weights would; a local folder is loaded as it is):

    python bench/gpu_plan_check.py                       # Qwen2.5-0.5B and 1.5B, a few shapes
    python bench/gpu_plan_check.py --model /models/qwen2.5-0.5b --batch 8 --seq 1024

For each case it runs a few optimizer steps of bf16 weights + peft LoRA (fp32 adapters) + AdamW
with transformers' own loss (the path the workbench trainer takes, DeepSpeed aside), and records
torch's peak allocated and reserved memory and what the device reports in use (CUDA context
included), next to the planner's per-component prediction. It prints one line per case and writes
JSON (default bench/results/gpu_plan_check-<gpu>.json). Nothing is claimed until this has run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from workbench.plan import GiB, model_shape, plan
from workbench.spec import RunSpec
from workbench.targets.gpus import detect_gpu_type

DEFAULT_CASES = [
    # (model, batch, seq, gradient checkpointing)
    ("Qwen/Qwen2.5-0.5B", 4, 1024, False),
    ("Qwen/Qwen2.5-0.5B", 4, 1024, True),
    ("Qwen/Qwen2.5-0.5B", 8, 2048, True),
    ("Qwen/Qwen2.5-1.5B", 4, 1024, False),
    ("Qwen/Qwen2.5-1.5B", 2, 2048, True),
]


def _build_model(model_id: str) -> Any:
    from transformers import AutoModelForCausalLM

    from workbench.plan import _config_for

    if Path(model_id).is_dir():
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16)
    cfg, _ = _config_for(model_id, None, False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def measure(model_id: str, batch: int, seq: int, gc: bool, steps: int, rank: int,
            gpu_type: str) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    spec = RunSpec.parse({
        "model": {"id": model_id},
        "method": {"kind": "lora", "lora_r": rank, "target_modules": "all-linear"},
        # The loop below runs transformers' own loss and kernels, so the plan models those (the
        # trainer's Liger fast paths are measured by `make gpu-check`).
        "train": {"batch_size": batch, "gradient_checkpointing": gc, "max_steps": steps,
                  "fast": {"liger": "off"}},
        "data": {"max_length": seq, "packing": True},
        "resources": {"gpus_per_node": 1, "gpu_type": gpu_type},
        "parallel": {"strategy": "ddp"},
    })
    predicted = plan(spec)

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0, total = torch.cuda.mem_get_info()
    model = _build_model(model_id).cuda()
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                             target_modules="all-linear"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    free1, _ = torch.cuda.mem_get_info()
    row = {
        "model": model_id, "batch": batch, "seq": seq, "gradient_checkpointing": gc,
        "lora_r": rank, "steps": steps,
        "params": model_shape(model_id).params,
        "measured_gib": {
            "max_allocated": torch.cuda.max_memory_allocated() / GiB,
            "max_reserved": torch.cuda.max_memory_reserved() / GiB,
            # What nvidia-smi would show for this process: reserved cache + CUDA context.
            "device_used_after": (total - free1) / GiB,
            "device_used_before_model": (total - free0) / GiB,
        },
        "predicted_gib": predicted.memory.to_dict(),
        "seconds_per_step": {
            "measured": seconds,
            "predicted": predicted.hours * 3600 / steps if predicted.hours else None,
        },
    }
    row["ratio_predicted_total_to_device_used"] = (
        predicted.memory.total / row["measured_gib"]["device_used_after"])
    row["ratio_predicted_without_fixed_overhead_to_max_reserved"] = (
        (predicted.memory.total - 0.9) / row["measured_gib"]["max_reserved"])
    del model, opt, ids
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="hub id known offline, or a local model folder")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--gpu-type", help="table name; default: detected")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_plan_check needs a CUDA GPU; nothing measured")
    gpu_type = args.gpu_type or detect_gpu_type()
    if gpu_type is None:
        raise SystemExit(f"unknown card {torch.cuda.get_device_name(0)!r}: pass --gpu-type "
                         "or add it to $WORKBENCH_HOME/gpus.yaml")
    cases = ([(args.model, args.batch, args.seq, args.gc)] if args.model else DEFAULT_CASES)
    rows = []
    for model_id, batch, seq, gc in cases:
        row = measure(model_id, batch, seq, gc, args.steps, args.rank, gpu_type)
        rows.append(row)
        m, p = row["measured_gib"], row["predicted_gib"]
        print(f"{model_id} b={batch} s={seq} gc={gc}: predicted {p['total']:.2f} GiB, device "
              f"used {m['device_used_after']:.2f} GiB (torch reserved {m['max_reserved']:.2f}, "
              f"allocated {m['max_allocated']:.2f}); ratio "
              f"{row['ratio_predicted_total_to_device_used']:.3f}", flush=True)
    result = {
        "device": torch.cuda.get_device_name(0), "gpu_type": gpu_type,
        "torch": torch.__version__, "python": platform.python_version(),
        "cases": rows,
    }
    out = args.out or Path(__file__).parent / "results" / f"gpu_plan_check-{gpu_type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
