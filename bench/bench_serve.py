"""Benchmark deployment (issue 5 targets), measured side by side in one run:

  deploy overhead   run finished -> endpoint healthy through workbench.deploy
                    / the same vLLM command, flags and environment started by hand   target <= 1.1
  serving speed     endpoint tokens/s / transformers generate tokens/s on the same prompts,
                    with the same batch shape (--batch prompts per transformers batch, as many
                    requests in flight at the endpoint), each side's tokens counted from its own
                    output

Each repeat starts vLLM both ways, end to end (call -> /health answers); the side that goes first
alternates (hand then workbench, then workbench then hand, ...) so a warm page cache favours
neither. The ratio is of the measured medians, never computed from a part of one side.

    python bench/bench_serve.py [--repeats 4] [--copies 4] [--batch 16] [--skip-speed]
                                                           (writes bench/results/serve.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("vLLM did not become healthy")


def by_hand(job, tmp: Path) -> float:
    """Start vLLM directly with exactly the command and environment deploy() would use."""
    from workbench.serve import (
        _max_lora_rank,
        _on_cpu,
        free_port,
        plan_serving,
        probe_serving_python,
        serving_python,
        vllm_command,
        vllm_env,
    )

    python = serving_python()
    plan = plan_serving([job])  # outside the timed part: it is what a person types
    on_cpu = _on_cpu(probe_serving_python(python))
    workdir = tmp / f"hand-{time.time_ns()}"
    (workdir / "cache").mkdir(parents=True)
    (workdir / "tmp").mkdir()
    port = free_port("127.0.0.1")
    cmd = vllm_command(python, plan, "127.0.0.1", port, 256, _max_lora_rank(plan.adapters, None),
                       on_cpu, workdir)
    env = {**os.environ, **vllm_env(plan, workdir, on_cpu)}
    t0 = time.time()
    with (workdir / "server.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_health(f"http://127.0.0.1:{port}", proc)
        return time.time() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def with_workbench(job, i: int) -> tuple[float, object]:
    import workbench

    t0 = time.time()
    ep = workbench.deploy(job, name=f"bench-{i}", progress=False)
    seconds = time.time() - t0
    # What workbench adds before vLLM even starts (checks, guard process): the part of the ratio
    # that does not drown in start-up noise when other work shares the machine.
    ep.spawn_delay_s = (ep.dir / "server.pid").stat().st_mtime - t0  # type: ignore[attr-defined]
    return seconds, ep


def hf_token_ids(chat, prompts: list[str], new: int, batch: int) -> list[list[int]]:
    """transformers' greedy replies as token ids, ``batch`` prompts at a time, each cut after its
    first end-of-sequence token (what vLLM returns: the stop token and nothing after it)."""
    import torch

    tok = chat.tokenizer
    tok.padding_side = "left"
    cfg_eos = chat.model.generation_config.eos_token_id
    eos = {tok.eos_token_id, *(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])} - {None}
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True)
                 for p in prompts[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = chat.model.generate(**enc, max_new_tokens=new, do_sample=False,
                                      pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
    return out


def speeds(ep, job, copies: int, batch: int) -> dict:
    """Two workloads: the run's adapter on the teaching prompts (one-word answers), and the base
    model writing 64 tokens per prompt (it never stops early: it has learnt nothing).

    Same batch shape on both sides: transformers generates ``batch`` prompts at a time, the
    endpoint gets ``batch`` requests in flight at a time. Each side's tokens are counted from its
    own output, so a side that stops early (or runs on) is not credited with the other's work.
    """
    from workbench.assets.teaching import teaching_rows
    from workbench.serve.infer import load_chat_model

    prompts = [r["instruction"] for r in teaching_rows("heldout")] * copies
    out = {}
    for label, source, model, new in (("adapter_teaching", job, job.name, 16),
                                      ("base_64_tokens", "builtin:tiny-llama", "tiny-llama", 64)):
        chat = load_chat_model(source)
        hf_token_ids(chat, prompts[:batch], new, batch)  # warm-up on both sides
        ep.generate_token_ids(prompts[:batch], model=model, max_new_tokens=new, concurrency=batch)
        t0 = time.time()
        hf_ids = hf_token_ids(chat, prompts, new, batch)
        hf_s = time.time() - t0
        t0 = time.time()
        ep_ids = [ids for _, ids in ep.generate_token_ids(prompts, model=model,
                                                         max_new_tokens=new, concurrency=batch)]
        ep_s = time.time() - t0
        hf_tokens, ep_tokens = sum(map(len, hf_ids)), sum(map(len, ep_ids))
        out[label] = {"prompts": len(prompts), "max_new_tokens": new, "batch": batch,
                      "transformers_tokens": hf_tokens, "endpoint_tokens": ep_tokens,
                      "same_ids": sum(a == b for a, b in zip(hf_ids, ep_ids)),
                      "transformers_s": hf_s, "endpoint_s": ep_s,
                      "transformers_tokens_per_s": hf_tokens / hf_s,
                      "endpoint_tokens_per_s": ep_tokens / ep_s,
                      "speed_ratio": (ep_tokens / ep_s) / (hf_tokens / hf_s)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--copies", type=int, default=4, help="times the 48 held-out prompts repeat")
    ap.add_argument("--batch", type=int, default=16,
                    help="prompts per transformers batch = requests in flight at the endpoint")
    ap.add_argument("--out", default=str(HERE / "results" / "serve.json"))
    ap.add_argument("--skip-speed", action="store_true",
                    help="measure deploy only; keep the serving figures already in --out")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    os.environ.setdefault("WORKBENCH_HOME", str(tmp / "home"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import workbench

    job = workbench.launch({"name": "bench-serve", "train": {"epochs": 20, "lr": 3e-3}})
    assert job.wait(progress=False) == "succeeded", job.logs()
    hand: list[float] = []
    wb: list[float] = []
    spawn: list[float] = []  # deploy() called -> vLLM process started
    load: list[float] = []  # 1-minute load average: other work on the machine skews both sides
    speed = None
    for i in range(args.repeats):  # alternate which side starts first: a warm cache favours neither
        for side in ("hand", "workbench") if i % 2 == 0 else ("workbench", "hand"):
            if side == "hand":
                hand.append(by_hand(job, tmp))
                continue
            seconds, ep = with_workbench(job, i)
            wb.append(seconds)
            spawn.append(ep.spawn_delay_s)
            if speed is None and not args.skip_speed:
                speed = speeds(ep, job, args.copies, args.batch)
            ep.stop()
        load.append(os.getloadavg()[0])
        print(f"repeat {i}: by hand {hand[-1]:.1f} s, workbench {wb[-1]:.1f} s, "
              f"load {load[-1]:.1f}", flush=True)
    if speed is None and Path(args.out).is_file():
        speed = json.loads(Path(args.out).read_text()).get("serving")
    result = {
        "deploy": {"workbench_s": wb, "by_hand_s": hand,
                   "ratio_median": statistics.median(wb) / statistics.median(hand),
                   "pair_ratios": [w / h for w, h in zip(wb, hand)], "load_average": load,
                   # a breakdown only (deploy() called -> vLLM process started), not a ratio
                   "spawn_delay_s": spawn,
                   "order": ["hand first" if i % 2 == 0 else "workbench first"
                             for i in range(args.repeats)],
                   "target": "<= 1.1"},
        "serving": speed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
