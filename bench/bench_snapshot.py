"""Benchmark snapshots (issue 4 targets), side by side in one run, JSON in bench/results/.

  time lost per snapshot   (train runtime with snapshots - without) / snapshots,
                           divided by a synchronous torch.save of the same state   target <= 0.2
  snapshot write speed     bytes / background write time, divided by a plain copy of the same
                           bytes (shutil.copytree of the committed snapshot)

A ~28M-parameter Llama (full fine-tuning, so the state is weights + Adam moments, ~340 MB) is
built from a config: big enough that writing takes real time, small enough for two CPU cores.

    python bench/bench_snapshot.py [--steps 12] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from workbench.assets import builtin_model_path

    tok = AutoTokenizer.from_pretrained(builtin_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(spec: dict) -> dict:
    import workbench

    job = workbench.launch(spec)
    assert job.wait(progress=False) == "succeeded", job.logs(tail=20)
    events = [m for m in map(json.loads, job.run_dir.metrics_file.read_text().splitlines())
              if m.get("event") == "snapshot"]
    return {"runtime": job.status()["summary"]["train_runtime"], "events": events, "job": job}


def sync_save_seconds(snapshot: Path, repeats: int = 3) -> float:
    """A plain synchronous torch.save of the same state (weights + optimizer), median."""
    import torch
    from safetensors.torch import load_file

    state = {"model": load_file(str(snapshot / "model.safetensors")),
             "optimizer": torch.load(snapshot / "optimizer.pt", weights_only=False)}
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            t = time.perf_counter()
            torch.save(state, Path(tmp) / f"s{i}.pt")
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_seconds(snapshot: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        shutil.copytree(snapshot, Path(tmp) / "copy")
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "snapshot.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="wb-snapbench-"))
    os.environ.setdefault("WORKBENCH_HOME", str(tmp / "home"))
    model = build_model(tmp / "model")
    base = {"model": {"id": str(model)}, "method": {"kind": "full"},
            "train": {"max_steps": args.steps, "batch_size": 4, "lr": 1e-4},
            "data": {"max_length": 64, "validation_fraction": 0.0},
            "tracking": {"tensorboard": False}, "checkpoint": {"keep": 1}}
    without = run({**base, "name": "nosnap"})
    with_snap = run({**base, "name": "snap", "checkpoint": {"every_steps": args.every, "keep": 1}})
    n = len(with_snap["events"])
    lost = (with_snap["runtime"] - without["runtime"]) / n
    newest = sorted((with_snap["job"].run_dir.path / "checkpoints").glob("step-*"))[-1]
    sync = sync_save_seconds(newest)
    nbytes = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    write = statistics.median(e["write_s"] for e in with_snap["events"])
    copy = copy_seconds(newest)
    result = {
        "snapshots": n, "snapshot_bytes": nbytes,
        "train_runtime_s": {"without": without["runtime"], "with": with_snap["runtime"]},
        "time_lost_per_snapshot_s": lost,
        "stall_per_snapshot_s": statistics.median(e["stall_s"] for e in with_snap["events"]),
        "sync_torch_save_s": sync,
        "write_s": write, "copy_s": copy,
        "ratios": {"time_lost_over_sync_save": lost / sync,
                   "stall_over_sync_save": statistics.median(
                       e["stall_s"] for e in with_snap["events"]) / sync,
                   "write_throughput_over_copy": (nbytes / write) / (nbytes / copy)},
        "targets": {"time_lost_over_sync_save": "<= 0.2"},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
