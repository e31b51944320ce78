"""Benchmark GRPO's step time against SFT's, and the planner's GRPO factor against that ratio.

Both train LoRA on the built-in tiny model through workbench.launch, with the same batch (8
sequences per step) and the same sequence lengths: GRPO samples 4 completions of up to
``--completion`` tokens for each of 2 teaching prompts per step (beta 0.04, so a reference pass
too); SFT trains on the same prompts with an answer of that many tokens. The runs alternate
(SFT first, then GRPO first, ...) ``--repeats`` times, so a machine that slows down or speeds up
weighs on both alike. Step time: the median gap between consecutive steps' metrics lines, the
first two steps left out (warm-up).

Measured factor = median GRPO step / median SFT step. The planner's side, for the very same two
specs: ``plan().hours`` GRPO / SFT (what the user is shown), and ``stage_time_factor`` alone (GRPO
over SFT on the tokens the planner counts for GRPO's prompt rows). Other work on the machine
skews both kinds of run alike; the load average and the busy cores are recorded and the result
is marked ``idle`` or ``loaded``.

    python bench/bench_grpo.py [--steps 14] [--repeats 2] [--completion 32] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import workbench

HERE = Path(__file__).resolve().parent
PROMPTS_PER_STEP, GENERATIONS = 2, 4


def _busy_cores(seconds: float = 1.0) -> float:
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1), 2)


def write_data(folder: Path, completion_tokens: int) -> tuple[str, str, int]:
    """Prompt rows for GRPO and SFT rows of the same prompts with a ``completion_tokens``-token
    answer; returns both paths and that answer's token count."""
    from transformers import AutoTokenizer

    from workbench.assets import builtin_model_path
    from workbench.assets.teaching import teaching_rows

    tok = AutoTokenizer.from_pretrained(builtin_model_path())
    rows = list(teaching_rows("train"))
    words = [r["output"] for r in rows]
    answer, n = "", 0
    for w in words * 8:  # the shortest run of teaching answers with that many tokens
        answer = f"{answer} {w}".strip()
        n = len(tok(answer, add_special_tokens=False)["input_ids"])
        if n >= completion_tokens:
            break
    grpo, sft = folder / "prompts.jsonl", folder / "sft.jsonl"
    with grpo.open("w") as g, sft.open("w") as s:
        for r in rows:
            g.write(json.dumps({"prompt": r["instruction"], "answer": r["output"]}) + "\n")
            s.write(json.dumps({"instruction": r["instruction"], "input": "",
                                "output": answer}) + "\n")
    return str(grpo), str(sft), n


def spec(stage: str, data: str, args: argparse.Namespace) -> dict:
    method: dict = {"stage": stage}
    if stage == "grpo":
        method.update(num_generations=GENERATIONS, max_completion_length=args.completion,
                      rewards=[{"fn": "exact_match"}])
    return {"name": f"bench-{stage}", "method": method,
            "data": {"sources": [{"path": data}], "validation_fraction": 0.0,
                     "max_length": 256, "clean": {"enabled": False}},
            "train": {"max_steps": args.steps, "batch_size": PROMPTS_PER_STEP * GENERATIONS
                      // args.processes, "eval_every": 0, "lr": 1e-3},
            "resources": {"processes_per_node": args.processes},
            "checkpoint": {"every_steps": None, "every_minutes": None}}


def run(stage: str, data: str, args: argparse.Namespace) -> dict:
    busy = _busy_cores()
    job = workbench.launch(spec(stage, data, args))
    assert job.wait(progress=False) == "succeeded", job.logs(tail=30)
    lines = [m for m in job.metrics() if "loss" in m and "event" not in m]
    times = [m["time"] for m in lines]
    gaps = [b - a for a, b in zip(times[2:], times[3:])]
    out = {"stage": stage, "step_s": statistics.median(gaps), "steps_timed": len(gaps),
           "busy_cores_before": busy, "load_average": [round(x, 2) for x in os.getloadavg()]}
    if stage == "grpo":
        out["completion_mean_tokens"] = statistics.mean(
            m["completions/mean_length"] for m in lines)
    print(json.dumps(out), flush=True)
    return out


def planner_side(grpo_data: str, sft_data: str, args: argparse.Namespace) -> dict:
    from workbench.plan import plan
    from workbench.plan.stage import stage_cost, stage_time_factor
    from workbench.spec import RunSpec

    g, s = plan(RunSpec(**spec("grpo", grpo_data, args))), plan(RunSpec(**spec("sft", sft_data, args)))
    g_spec = RunSpec(**spec("grpo", grpo_data, args))
    tokens = g.tokens_per_step / (PROMPTS_PER_STEP * GENERATIONS)
    return {"plan_hours_ratio": g.hours / s.hours,
            "stage_time_factor": stage_time_factor(stage_cost(g_spec, tokens), "lora", tokens),
            "planner_tokens_per_grpo_example": tokens,
            "planner_tokens_per_sft_example": s.tokens_per_step / (PROMPTS_PER_STEP * GENERATIONS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--out", default=str(HERE / "results" / "grpo.json"))
    args = ap.parse_args()
    os.environ.setdefault("WORKBENCH_HOME", tempfile.mkdtemp(prefix="bench-grpo-"))
    folder = Path(tempfile.mkdtemp(prefix="bench-grpo-data-"))
    grpo_data, sft_data, answer_tokens = write_data(folder, args.completion)
    load_start = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict]] = {"sft": [], "grpo": []}
    for i in range(args.repeats):
        for stage in (("sft", "grpo") if i % 2 == 0 else ("grpo", "sft")):
            runs[stage].append(run(stage, grpo_data if stage == "grpo" else sft_data, args))
    sft_s = statistics.median(r["step_s"] for r in runs["sft"])
    grpo_s = statistics.median(r["step_s"] for r in runs["grpo"])
    planner = planner_side(grpo_data, sft_data, args)
    measured = grpo_s / sft_s
    busy = [r["busy_cores_before"] for rs in runs.values() for r in rs]
    result = {
        "steps": args.steps, "repeats": args.repeats, "processes": args.processes,
        "sequences_per_step": PROMPTS_PER_STEP * GENERATIONS,
        "max_completion_tokens": args.completion, "sft_answer_tokens": answer_tokens,
        "cpus": os.cpu_count(), "load_average_start": load_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "machine": "idle" if max(busy) < 0.3 else "loaded",
        "sft_step_s": sft_s, "grpo_step_s": grpo_s, "measured_factor": measured,
        **planner,
        "planner_over_measured": planner["plan_hours_ratio"] / measured,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
