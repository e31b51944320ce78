"""Benchmark evaluation (issue 13 targets), measured side by side in one run:

  eval throughput     heldout scoring through a served vLLM endpoint / the same scoring with
                      transformers generate in this process: same prompts, same max_new_tokens,
                      the same scorer (workbench.evaluate.runner.score), greedy both sides,
                      each with the batching its scorer uses by default (transformers: batches
                      of TransformersSource.batch_size; endpoint: sources.CONCURRENCY prompts
                      at once, which vLLM batches), each side's tokens counted from its own
                      answers (re-tokenised with the model's tokenizer)               target >= 2
  server start        deploy -> /health answers, reported on its own (not in the throughput)
  every_steps cost    (train_runtime of a run with eval.every_steps - the same run without)
                      / the evaluation seconds recorded inside it (eval.jsonl "seconds")
                      1.0: training loses exactly the evaluation's own time (it pauses)

Three throughput workloads: the run's adapter on the teaching prompts (short answers that stop
early), the base model writing up to 64 tokens per prompt (it never stops early), both on the
2-layer built-in model, where batched generate is so cheap that an endpoint's fixed costs per
request and per step dominate; and a model of realistic size (Qwen2.5-0.5B's shape, random
weights, built by bench_plan_accuracy.build_half_b_model) writing 64 tokens, on its own server,
float32 both sides (what vLLM serves on CPU). The side
that goes first alternates between repeats so a warm cache favours neither; the figures are
medians. The 1-minute load average is recorded with each repeat (other work on the machine
slows both sides).

    python bench/bench_eval.py [--repeats 2] [--copies 2] [--steps 24] [--every 6]
                               [--concurrency N] [--half-b-examples 32]
                               [--skip throughput|half_b|every_steps]
                                                          (writes bench/results/eval.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _qa_file(folder: Path, copies: int) -> Path:
    from workbench.assets.teaching import teaching_rows

    path = folder / "heldout.jsonl"
    rows = list(teaching_rows("heldout")) * copies
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokens(tokenizer: Any, answers: list[str]) -> int:
    return sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)


def _timed_score(source: Any, qa: Path, new: int, tokenizer: Any) -> dict[str, float]:
    from workbench.evaluate.runner import as_tasks, score

    tasks = as_tasks(["heldout"], file=str(qa), max_new_tokens=new)
    t0 = time.time()
    report = score(source, tasks, phase="manual", step=0)
    seconds = time.time() - t0
    answers = [r["prediction"] for r in report.examples["heldout"]]
    tokens = _tokens(tokenizer, answers)
    return {"seconds": seconds, "tokens": tokens, "examples": len(answers),
            "tokens_per_s": tokens / seconds, "examples_per_s": len(answers) / seconds,
            "exact_match": report.metrics["heldout.exact_match"], "answers": answers}


def _server_cpu_s(ep: Any) -> float:
    """CPU seconds of the endpoint's process tree (guard, API server, engine core): unlike wall
    time, barely moved by other work on the machine."""
    import psutil

    procs = [psutil.Process(ep.record.server_pid)]
    procs += procs[0].children(recursive=True)
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def throughput(ep: Any, workloads: list[tuple[str, Any, str, int]], qa: Path, repeats: int,
               concurrency: int) -> dict[str, Any]:
    from workbench.evaluate.sources import EndpointSource, open_weights

    out: dict[str, Any] = {}
    for label, weights, model, new in workloads:
        local = open_weights(weights)
        local.model.float()  # vLLM serves float32 on CPU; a bf16 checkpoint loads as bf16
        remote = EndpointSource(ep.api_base, model=model, api_key=ep.api_key,
                                concurrency=concurrency)
        sides: dict[str, list[dict[str, float]]] = {"transformers": [], "endpoint": []}
        load = []
        for i in range(repeats):
            order = ("transformers", "endpoint") if i % 2 == 0 else ("endpoint", "transformers")
            for side in order:
                src = local if side == "transformers" else remote
                server0, own0 = _server_cpu_s(ep), _own_cpu_s()
                sides[side].append(_timed_score(src, qa, new, local.tokenizer))
                sides[side][-1]["server_cpu_s"] = _server_cpu_s(ep) - server0
                sides[side][-1]["client_cpu_s"] = _own_cpu_s() - own0
            load.append(os.getloadavg()[0])
        same = sum(a == b for a, b in zip(sides["transformers"][0]["answers"],
                                          sides["endpoint"][0]["answers"]))
        med = {s: statistics.median(r["tokens_per_s"] for r in runs) for s, runs in sides.items()}
        out[label] = {
            "examples": sides["endpoint"][0]["examples"], "max_new_tokens": new,
            "transformers_batch": local.batch_size, "endpoint_prompts_at_once": remote.concurrency,
            "endpoint_path": "vLLM batch requests" if remote.is_vllm() else "chat requests",
            "same_answers": same,
            **{f"{s}_{k}": [r[k] for r in runs] for s, runs in sides.items()
               for k in ("seconds", "tokens", "tokens_per_s", "exact_match", "server_cpu_s",
                         "client_cpu_s")},
            "order": ["transformers first" if i % 2 == 0 else "endpoint first"
                      for i in range(repeats)],
            "load_average": load,
            "speed_ratio_median": med["endpoint"] / med["transformers"],
            "target": ">= 2", "meets_target": med["endpoint"] / med["transformers"] >= 2}
        print(label, json.dumps({k: v for k, v in out[label].items()}), flush=True)
    return out


def every_steps_cost(steps: int, every: int, repeats: int) -> dict[str, Any]:
    import workbench

    def one(with_eval: bool, i: int) -> dict[str, float]:
        ev: dict[str, Any] = {"after": False, "before": False}
        if with_eval:
            ev.update(every_steps=every, tasks=[{"kind": "heldout", "max_samples": 32}])
        job = workbench.launch({"name": f"bench-eval-{'on' if with_eval else 'off'}-{i}",
                                "train": {"max_steps": steps, "eval_every": 0},
                                "eval": ev})
        assert job.wait(progress=False) == "succeeded", job.logs()
        from workbench.evaluate import results

        lines = [ln for ln in results.read(job.run_dir.path) if ln["phase"] == "during"]
        return {"runtime": job.status()["summary"]["train_runtime"],
                "eval_s": sum(ln["seconds"] for ln in lines), "evals": len(lines)}

    runs: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    load = []
    for i in range(repeats):
        for side in ("without", "with") if i % 2 == 0 else ("with", "without"):
            runs[side].append(one(side == "with", i))
        load.append(os.getloadavg()[0])
        print(f"repeat {i}: {runs['with'][-1]} / {runs['without'][-1]}, load {load[-1]:.1f}",
              flush=True)
    pairs = [(w["runtime"] - wo["runtime"]) / w["eval_s"]
             for w, wo in zip(runs["with"], runs["without"])]
    return {"steps": steps, "every_steps": every,
            "evaluations_per_run": [r["evals"] for r in runs["with"]],
            "runtime_with_s": [r["runtime"] for r in runs["with"]],
            "runtime_without_s": [r["runtime"] for r in runs["without"]],
            "eval_s_inside": [r["eval_s"] for r in runs["with"]],
            "pair_ratios": pairs, "ratio_median": statistics.median(pairs),
            "load_average": load,
            "meaning": "training seconds lost per second of evaluation (1.0: it pauses)"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copies", type=int, default=2, help="times the 48 held-out prompts repeat")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="endpoint prompts at once (default: the scorer's, sources.CONCURRENCY)")
    ap.add_argument("--half-b-examples", type=int, default=32,
                    help="held-out prompts for the 0.5B workload (each writes 64 tokens)")
    ap.add_argument("--skip", default="",
                    help="throughput, half_b or every_steps: leave that part out")
    ap.add_argument("--out", default=str(HERE / "results" / "eval.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    os.environ.setdefault("WORKBENCH_HOME", str(tmp / "home"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import workbench
    from workbench.evaluate.sources import CONCURRENCY

    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(),
                                          "python": platform.python_version()},
                              "date": time.strftime("%Y-%m-%d"),
                              "load_average_at_start": os.getloadavg()[0]}
    if "throughput" not in args.skip:
        job = workbench.launch({"name": "bench-eval", "train": {"epochs": 20, "lr": 3e-3},
                                "eval": {"after": False}})
        assert job.wait(progress=False) == "succeeded", job.logs()
        t0 = time.time()
        ep = workbench.deploy(job, name="bench-eval", progress=False)
        result["server_start_s"] = time.time() - t0  # deploy -> healthy: not in the throughput
        workloads = [("adapter_teaching", job.run_dir.adapter_dir, job.name, 16),
                     ("base_64_tokens", "builtin:tiny-llama", "tiny-llama", 64)]
        try:
            result["throughput"] = throughput(ep, workloads, _qa_file(tmp, args.copies),
                                              args.repeats, args.concurrency or CONCURRENCY)
        finally:
            ep.stop()
    if "half_b" not in args.skip:
        from bench_plan_accuracy import build_half_b_model

        half_b = build_half_b_model(tmp / "qwen2-0.5b-random")
        t0 = time.time()
        ep = workbench.deploy(str(half_b), name="bench-eval-half-b", progress=False)
        result["half_b_server_start_s"] = time.time() - t0
        (tmp / "half_b").mkdir()
        qa = _qa_file(tmp / "half_b", 1)
        qa.write_text("".join(qa.read_text().splitlines(True)[:args.half_b_examples]))
        try:
            result.setdefault("throughput", {}).update(throughput(
                ep, [("half_b_base_64_tokens", str(half_b), ep.model, 64)], qa, args.repeats,
                args.concurrency or CONCURRENCY))
        finally:
            ep.stop()
    if "every_steps" not in args.skip:
        result["every_steps"] = every_steps_cost(args.steps, args.every, args.repeats)
    out = Path(args.out)
    if out.is_file():  # a part left out keeps its last measured figures, marked as such
        old = json.loads(out.read_text())
        for part in ("throughput", "every_steps"):
            if part in old:
                kept = {k: v for k, v in old[part].items() if k not in result.get(part, {})}
                if part == "every_steps" and part not in result:
                    kept = {"from_run_of": old.get("date"), **kept}
                elif part == "throughput":
                    kept = {k: {"from_run_of": old.get("date"), **v} for k, v in kept.items()}
                result[part] = {**kept, **result.get(part, {})} if kept else result.get(part)
        result = {k: v for k, v in result.items() if v is not None}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
