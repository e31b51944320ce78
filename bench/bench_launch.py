"""Launch latency: ``workbench launch`` of a tiny run against a plain ``torchrun`` of a minimal
Hugging Face Trainer script doing the same work (bench/plain_train.py: read the jsonl, tokenise,
load the model, LoRA, train), side by side.

Each round runs both, in alternating order (drift on a shared machine hits both alike): the same
built-in tiny model, the same teaching data, the same steps and processes (by default the issue's
case: 100 steps in 1 process, where the plain script is a plain ``python`` process; with
``--procs 2`` both sides run under torchrun). For each side it records
the time from the call to the first optimizer step being logged (the ``time`` of the first loss
line in metrics.jsonl; the plain script's first ``on_log``), and from the call to the command's
exit. The CLI is run as a user runs it (``workbench launch spec.yaml --wait``, a fresh process:
its imports and the plan are counted); so is the plain script. Target (issue 16): command -> done
<= 1.1x the plain script (``ratio_exit``); call -> first step is reported beside it.

    python bench/bench_launch.py [--steps 100] [--procs 1] [--rounds 4]
                                                        (writes bench/results/launch.json)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def workbench_side(spec_file: Path, env: dict[str, str]) -> dict[str, float]:
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", str(spec_file),
                           "--wait"], capture_output=True, text=True, env=env, check=False)
    t_exit = time.time()
    found = re.search(r"run dir (\S+)\)", done.stdout)
    if done.returncode != 0 or found is None or "succeeded" not in done.stdout:
        raise SystemExit(f"workbench launch failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    run_dir = Path(found[1])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    first = next(json.loads(x)["time"] for x in lines if '"loss"' in x)
    return {"first_step_s": first - t0, "exit_s": t_exit - t0, **phases(run_dir, t0, first)}


def phases(run_dir: Path, t0: float, first_step: float) -> dict[str, float]:
    """Where a workbench launch's time went, from its status.json: the CLI until the run
    directory exists (imports, plan, model check), until the supervisor has started (data
    prepared and tokenised, backend submit), until torchrun has started the ranks, and the
    ranks until their first step (imports, model and data load, Trainer set-up)."""
    status = json.loads((run_dir / "status.json").read_text())
    procs = status.get("processes") or []
    sup = min((p["create_time"] for p in procs if p["role"] == "supervisor"), default=None)
    rank = min((p["create_time"] for p in procs if p["role"] == "rank"), default=None)
    if sup is None or rank is None:
        return {}
    return {"phase_cli_to_run_dir_s": status["created"] - t0,
            "phase_run_dir_to_supervisor_s": sup - status["created"],
            "phase_supervisor_to_ranks_s": rank - sup,
            "phase_ranks_to_first_step_s": first_step - rank}


def plain_side(model_dir: str, data: Path, steps: int, procs: int, tmp: Path,
               env: dict[str, str]) -> dict[str, float]:
    out = tmp / f"plain-{time.time_ns()}.json"
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
                if procs > 1 else [])
    t0 = time.time()
    subprocess.run([sys.executable, *launcher, str(HERE / "plain_train.py"), model_dir,
                    str(data), str(steps), str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_exit = time.time()
    r = json.loads(out.read_text())
    return {"first_step_s": r["first_step_time"] - t0, "exit_s": t_exit - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "launch.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="wb-bench-launch-"))
    # The venv's editable install imports this checkout's package; its root stays off sys.path.
    env = {**os.environ, "WORKBENCH_HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1"}
    os.environ.update(WORKBENCH_HOME=env["WORKBENCH_HOME"])
    from workbench.assets import builtin_dataset_path, builtin_model_path

    model_dir, data = str(builtin_model_path("builtin:tiny-llama")), builtin_dataset_path()
    spec_file = tmp / "spec.yaml"
    # The plain script's knobs (batch 8, max_length 256, LoRA r16/a32 all-linear) are the
    # spec's defaults; no validation split, evaluation or TensorBoard, which it has none of.
    spec_file.write_text(
        f"name: launch-bench\ntrain: {{max_steps: {args.steps}, lr: 0.003}}\n"
        "data: {validation_fraction: 0.0}\ntracking: {tensorboard: false}\n"
        f"resources: {{gpus_per_node: 0, processes_per_node: {args.procs}}}\n")
    runs: dict[str, list[dict[str, float]]] = {"workbench": [], "plain": []}
    for r in range(args.rounds):
        for side in ("workbench", "plain") if r % 2 == 0 else ("plain", "workbench"):
            runs[side].append(workbench_side(spec_file, env) if side == "workbench"
                              else plain_side(model_dir, data, args.steps, args.procs, tmp, env))
            print(f"round {r} {side}: {runs[side][-1]}", flush=True)
    med = {side: {k: statistics.median(x[k] for x in rs if k in x) for k in rs[0]}
           for side, rs in runs.items()}
    result = {
        "steps": args.steps, "rounds": args.rounds, "processes": args.procs, "model": "builtin:tiny-llama",
        "median_s": med, "runs": runs,
        "ratio_first_step": med["workbench"]["first_step_s"] / med["plain"]["first_step_s"],
        "ratio_exit": med["workbench"]["exit_s"] / med["plain"]["exit_s"],
        "target_ratio_exit": "<= 1.1 (issue 16: command -> done)",
        "load_average_after": os.getloadavg(), "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "ratio_first_step", "ratio_exit")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
