"""Benchmark: launch -> first training step for a large set of short rows (issue 24), JSON in
bench/results/data_start.json.

Three launches of the same data, 2 processes on the built-in tiny model, one after another:

  per_rank   the path before tokenise-once: launch only prepares the jsonl and every rank
             tokenises the whole set itself (today the fallback for old run dirs; reached here by
             launching with the data step's tokenising turned off)
  once       tokenised once in the launching process into Arrow, ranks memory-map it (cold cache)
  cached     the same data again: the cache is linked into the run dir, nothing is tokenised

Each figure is seconds from calling launch() to the first metrics line with a loss, with the
launch call's own share. Ratios: once / per_rank (target <= 0.3) and cached / per_rank
(target <= 0.1). Other work on the machine skews every figure: the load average is recorded.

    python bench/bench_data_start.py [--rows 200000] [--home DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _rows(n: int) -> list[dict]:
    return [{"instruction": f"Repeat the number {i}.", "input": "", "output": str(i)}
            for i in range(n)]


def _first_step(job, deadline_s: float = 1800) -> float:
    end = time.time() + deadline_s
    while time.time() < end:
        if any("loss" in m for m in job.metrics()):
            return time.time()
        if job.done:
            raise RuntimeError(f"{job.id} ended {job.state} before a step: {job.logs(tail=20)}")
        time.sleep(0.2)
    raise TimeoutError(job.id)


def _one(label: str, spec: dict) -> dict:
    import importlib

    import workbench

    jobs = importlib.import_module("workbench.launching")

    original = jobs._prepare_data
    if label == "per_rank":
        from workbench.data.prepare import prepare_data

        def old(spec, rd):  # the data step as it was: the ranks tokenise the jsonl themselves
            rd.write_status(data=prepare_data(spec, rd.data_dir).counts)

        jobs._prepare_data = old
    try:
        t0 = time.time()
        job = workbench.launch({**spec, "name": f"bench-{label.replace('_', '-')}"})
        launched = time.time()
    finally:
        jobs._prepare_data = original
    first = _first_step(job)
    job.cancel()
    prepare = job.status().get("prepare") or {}
    return {"label": label, "launch_s": round(launched - t0, 2),
            "launch_to_first_step_s": round(first - t0, 2),
            "tokenise_s": prepare.get("seconds"), "cache_hit": prepare.get("cache_hit"),
            "load_avg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    os.environ["WORKBENCH_HOME"] = args.home or tempfile.mkdtemp(prefix="wb-bench-data-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = Path(os.environ["WORKBENCH_HOME"]) / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(args.rows)))
    spec = {"data": {"sources": [{"path": str(data)}], "max_length": 64},
            "train": {"max_steps": 1000, "batch_size": 8}}
    results = [_one(label, spec) for label in ("per_rank", "once", "cached")]
    base = results[0]["launch_to_first_step_s"]
    out = {"rows": args.rows, "processes": 2, "runs": results,
           "once_vs_per_rank": round(results[1]["launch_to_first_step_s"] / base, 3),
           "cached_vs_per_rank": round(results[2]["launch_to_first_step_s"] / base, 3),
           "targets": {"once_vs_per_rank": 0.3, "cached_vs_per_rank": 0.1}}
    path = Path(__file__).parent / "results" / "data_start.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
