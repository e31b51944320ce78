"""Benchmark snapshots (issue 4 targets), side by side in one run, JSON in bench/results/.

  time lost per snapshot   two estimates, each divided by a synchronous torch.save of the
                           same state                                              target <= 0.2
                           - whole runs: (fastest train runtime with snapshots - without) /
                             snapshots per run
                           - within a run: the steps run while the writer was busy, against
                             the quiet steps just after them (``lost_within_run``), with the
                             runs without snapshots read the same way as a control
  stall per snapshot       what training waits for (the Trainer's save, any wait there for
                           the previous writer, the next optimizer step's wait for the
                           copy), same divisor
  snapshot write speed     bytes / background write time, divided by a plain copy of the same
                           bytes (shutil.copytree of the committed snapshot), and by a copy plus
                           the sha256 the manifest needs

Two configurations, each trained without and with snapshots (alternating, ``--repeats`` times):

  all_cores    2 training ranks on the 2 cores: the writer thread competes with training for CPU
  spare_core   1 training rank, 1 torch thread, pinned to one core; the writer thread allowed only
               on another (WORKBENCH_SNAPSHOT_WRITER_CPUS): a GPU node, where training runs on the
               accelerator and host cores are free for the writer

A ~28M-parameter Llama (full fine-tuning, so the state is weights + Adam moments, ~340 MB) is
built from a config: big enough that writing takes real time, small enough for two CPU cores.
Other work on the machine skews every figure: each run waits (up to --settle s) for the other
work to quieten, the cores it still kept busy are recorded, and so is the load average. The
machine's speed also drifts on its own (by a quarter, for seconds at a time), which whole-run
times cannot tell from a snapshot's cost; the within-run estimate compares steps seconds apart.

    python bench/bench_snapshot.py [--steps 48] [--every 8] [--repeats 3] [--settle 30]
                                   [--configs all_cores,spare_core]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import workbench

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


def run_job(job: workbench.Job) -> dict:
    assert job.wait(progress=False) == "succeeded", job.logs(tail=20)
    rows = [json.loads(line) for line in job.run_dir.metrics_file.read_text().splitlines()]
    return {"runtime": job.status()["summary"]["train_runtime"],
            "events": [m for m in rows if m.get("event") == "snapshot"],
            "step_end": {m["step"]: m["time"] for m in rows if "loss" in m and "event" not in m},
            "job": job}


def lost_within_run(step_end: dict[int, float], saves: list[tuple[int, float]]) -> list[float]:
    """Time lost to each snapshot, against the quiet steps around it in the same run.

    ``saves``: (step saved at, time its writer finished). The steps after a save that ran while
    its writer was busy are "active"; the other steps until the next save are "quiet". Lost =
    the active steps' durations minus as many quiet steps (their median). Both kinds come from
    the same few seconds, so the slow drifts of a shared machine's speed (steps 0.25 s for a
    while, then 0.32 s, in runs with and without snapshots alike) cancel out; whole-run times
    cannot tell a 0.02 s effect from them. Saves with no quiet step before the next are left out.
    """
    duration = {k: step_end[k] - step_end[k - 1] for k in step_end if k - 1 in step_end}
    out = []
    for i, (step, finished) in enumerate(saves):
        until = saves[i + 1][0] if i + 1 < len(saves) else max(step_end)
        window = [k for k in range(step + 1, until + 1) if k in duration]
        active = [k for k in window if step_end[k - 1] < finished]
        quiet = [duration[k] for k in window if k not in active]
        if active and quiet:
            out.append(sum(duration[k] for k in active) - len(active) * statistics.median(quiet))
    return out


def sync_save_seconds(snapshot: Path, repeats: int = 7) -> list[float]:
    """A plain synchronous torch.save of the same state (weights + optimizer), each time."""
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
            (Path(tmp) / f"s{i}.pt").unlink()
    return times


def copy_seconds(snapshot: Path, hash_too: bool = False) -> float:
    """A plain copy of the snapshot's files; ``hash_too``: and a sha256 of each copy (the least
    any writer with a sha256 manifest has to do)."""
    from workbench.runs.snapshots import sha256_file

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        shutil.copytree(snapshot, Path(tmp) / "copy")
        if hash_too:
            for p in (Path(tmp) / "copy").iterdir():
                sha256_file(p)
        return time.perf_counter() - t


# The target, by both estimates of the time lost (see lost_within_run).
TARGETS = {"time_lost_over_sync_save": 0.2, "time_lost_within_run_over_sync_save": 0.2}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by other work right now (from /proc/stat), unlike the load average, which
    still counts this benchmark's previous run for a minute after it ended."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # all, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1), 2)


def wait_quiet(limit_s: float, threshold: float = 0.3) -> float:
    """Wait (at most ``limit_s``) until other work uses less than ``threshold`` cores."""
    deadline = time.time() + limit_s
    busy = busy_cores()
    while busy >= threshold and time.time() < deadline:
        busy = busy_cores(2.0)
    return busy


@contextmanager
def pinned(cpus: set[int] | None, env: dict[str, str]):
    """Launch under this CPU affinity and environment (the run's processes inherit both)."""
    before, saved = os.sched_getaffinity(0), {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(name: str, base: dict, args: argparse.Namespace, procs: int,
            cpus: set[int] | None, env: dict[str, str]) -> dict:
    """Runs without and with snapshots, alternating. Other work on the machine only ever adds
    time, so the fastest run of each kind is the estimate (every runtime is kept)."""
    base = {**base, "resources": {"processes_per_node": procs}}
    runtimes: dict[str, list[float]] = {"without": [], "with": []}
    busy: dict[str, list[float]] = {"without": [], "with": []}
    within: dict[str, list[float]] = {"without": [], "with": []}
    events, newest = [], None
    for i in range(args.repeats):
        # Alternate which goes first, so neither always runs on the machine the other warmed
        # (page cache, CPU frequency) or in the other's wake.
        order = ("without", "with") if i % 2 == 0 else ("with", "without")
        pair: dict[str, dict] = {}
        for kind in order:
            spec = {**base, "name": f"{name}-{kind}-{i}"}
            if kind == "with":
                spec["checkpoint"] = {"every_steps": args.every, "keep": 1}
            busy[kind].append(wait_quiet(args.settle))
            with pinned(cpus, env):
                job = workbench.launch(spec)
            out = run_job(job)
            runtimes[kind].append(out["runtime"])
            pair[kind] = out
            if kind == "with":
                events += out["events"]
                newest = sorted((job.run_dir.path / "checkpoints").glob("step-*"))[-1]
        out, plain = pair["with"], pair["without"]["step_end"]
        saves = [(e["step"], e["time"]) for e in out["events"]]
        within["with"] += lost_within_run(out["step_end"], saves)
        # the control: the run without snapshots of the same pair, read as if it had saved at
        # the same steps and been as long busy after each (should come out near 0)
        within["without"] += lost_within_run(plain, [
            (step, plain[step] + (t - out["step_end"][step])) for step, t in saves
            if step in plain and step in out["step_end"]])
    n = len(events) // args.repeats
    lost = (min(runtimes["with"]) - min(runtimes["without"])) / n
    return {"ranks": procs, "training_cpus": sorted(cpus) if cpus else "all",
            "writer_cpus": env.get("WORKBENCH_SNAPSHOT_WRITER_CPUS", "all"),
            "snapshots_per_run": n, "train_runtime_s": runtimes,
            "other_work_busy_cores_at_launch": busy,
            "time_lost_per_snapshot_s": lost,
            "time_lost_within_run_s": {k: statistics.median(v) if v else None
                                       for k, v in within.items()},
            "time_lost_within_run_counted": {k: len(v) for k, v in within.items()},
            "stall_per_snapshot_s": statistics.median(e["stall_s"] for e in events),
            "write_s": statistics.median(e["write_s"] for e in events),
            "newest": newest}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", type=int, default=8,
                    help="steps between snapshots: room for quiet steps after each write")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=30.0,
                    help="before each run, wait up to this long for other work to quieten")
    ap.add_argument("--configs", default="all_cores,spare_core",
                    help="which configurations to run, comma-separated")
    ap.add_argument("--out", default=str(HERE / "results" / "snapshot.json"))
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "needs two cores: one to train on, one for the writer"
    tmp = Path(tempfile.mkdtemp(prefix="wb-snapbench-"))
    os.environ.setdefault("WORKBENCH_HOME", str(tmp / "home"))
    load_start = _load()
    model = build_model(tmp / "model")
    base = {"model": {"id": str(model)}, "method": {"kind": "full"},
            "train": {"max_steps": args.steps, "batch_size": 4, "lr": 1e-4},
            "data": {"max_length": 64, "validation_fraction": 0.0},
            "tracking": {"tensorboard": False}, "checkpoint": {"keep": 1}}
    setups = {
        "all_cores": lambda: measure("all", base, args, 2, None, {}),
        "spare_core": lambda: measure("spare", base, args, 1, {cpus[0]}, {
            "OMP_NUM_THREADS": "1", "WORKBENCH_SNAPSHOT_WRITER_CPUS": str(cpus[1])}),
    }
    chosen = args.configs.split(",")
    unknown = set(chosen) - set(setups)
    if unknown:
        ap.error(f"unknown configuration(s) {sorted(unknown)}; choose from {sorted(setups)}")
    configs = {name: setups[name]() for name in chosen}
    newest = configs[chosen[-1]]["newest"]
    with pinned({cpus[0]}, {}):  # what a rank would pay on its core to save synchronously
        sync_all = sync_save_seconds(newest)
    sync = statistics.median(sync_all)  # it varies too (0.23-0.46 s here on different runs)
    nbytes = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    copy = copy_seconds(newest)
    copy_hash = copy_seconds(newest, hash_too=True)
    for c in configs.values():
        c.pop("newest")
        within = c["time_lost_within_run_s"]
        ratios = {"time_lost_over_sync_save": c["time_lost_per_snapshot_s"] / sync,
                  "time_lost_within_run_over_sync_save": (within["with"] or float("nan")) / sync,
                  "control_within_run_over_sync_save": (within["without"] or float("nan")) / sync,
                  "within_run_minus_control_over_sync_save":
                      ((within["with"] or float("nan")) - (within["without"] or 0.0)) / sync,
                  "stall_over_sync_save": c["stall_per_snapshot_s"] / sync,
                  "write_throughput_over_copy": copy / c["write_s"],
                  "write_throughput_over_copy_plus_sha256": copy_hash / c["write_s"]}
        c["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
        c["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()}
        c["met"] = {k: ratios[k] <= v for k, v in TARGETS.items()}
    result = {
        "steps": args.steps, "every": args.every, "repeats": args.repeats,
        "cpus": len(cpus), "load_average_start": load_start, "load_average_end": _load(),
        "how": "time lost = (fastest run with snapshots - fastest without) / snapshots per run; "
               "time lost within run: per snapshot, the steps run while its writer was busy "
               "minus as many of the quiet steps after them (median), median over snapshots; "
               "its control reads each run without snapshots the same way (should be ~0); "
               "stall and write_s: medians over the snapshots; stall = the Trainer's save, any wait "
               "there for the previous writer, and the next optimizer step's wait for the "
               "copy; write_s runs from the start of "
               "the Trainer's save to the commit (copy, write, sha256, manifest, prune)",
        "snapshot_bytes": nbytes, "sync_torch_save_s": sync,
        "sync_torch_save_each_s": [round(t, 4) for t in sync_all], "copy_s": copy,
        "copy_plus_sha256_s": copy_hash,
        "configs": configs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
