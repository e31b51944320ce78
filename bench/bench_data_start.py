"""Benchmark: launch -> first training step for a large set of short rows (issue 24), JSON in
bench/results/data_start.json.

The same spec (200,000 alpaca rows, max_length 64, built-in tiny model, 2 processes) is launched
by three code versions, each in a fresh Python process, so every launch pays its own imports:

  old     the code before tokenise-once (commit 8817a9e, the parent of the first tokenise-once
          commit), checked out into a temporary ``git worktree`` and first on PYTHONPATH: launch
          writes the jsonl and every rank tokenises the whole set itself
  cold    this checkout, with an empty tokenised-data cache: tokenised once at launch
  cached  this checkout again on the same data: the cache is linked into the run dir

The figure is the issue's "launch -> first step": seconds from the moment ``launch()`` is called
(after ``import workbench``, which is all the launching process imports first) to the first
metrics line with a loss, the same clock for every side; whatever launch() imports itself
(torch and transformers, on every side) is inside it. ``with_imports_s`` is the same end from the
child's start, ``import workbench`` included, kept as a second column. Before any timed run each
side's WORKBENCH_HOME gets the built-in tiny model built by that side's own code, untimed, so no
side's first run pays for building it, and each side's package is byte-compiled, untimed, as
Python does on a first import (this machine sets PYTHONDONTWRITEBYTECODE, so without it every
process of every side compiles the package's sources again). The order alternates (old, cold,
cached, then cached, cold, old, ...) so a change in the machine's load does not favour one side;
the load average is recorded with every run. Ratios use the median of each label: cold / old
(target <= 0.3) and cached / old (target <= 0.1).

    python bench/bench_data_start.py [--rows 200000] [--rounds 3] [--old-commit 8817a9e]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "8817a9e"

# Runs in the child: launch, wait for the first loss, cancel, print one JSON line.
_CHILD = r"""
import json, os, sys, time
t0 = time.time()
import workbench
spec = json.loads(sys.argv[1])
called = time.time()
job = workbench.launch(spec)
launched = time.time()
end = launched + 1800
while time.time() < end:
    if any("loss" in m for m in job.metrics()):
        break
    if job.done:
        raise SystemExit(f"{job.id} ended {job.state} before a step: {job.logs(tail=20)}")
    time.sleep(0.1)
else:
    raise SystemExit(f"{job.id}: no step within 1800 s")
first = time.time()
job.cancel()
prepare = job.status().get("prepare") or {}
print("RESULT " + json.dumps({
    "package": os.path.dirname(workbench.__file__), "launch_s": round(launched - called, 2),
    "launch_to_first_step_s": round(first - called, 2),
    "with_imports_s": round(first - t0, 2), "tokenise_s": prepare.get("seconds"),
    "cache_hit": prepare.get("cache_hit")}))
"""


def _rows(n: int) -> list[dict]:
    return [{"instruction": f"Repeat the number {i}.", "input": "", "output": str(i)}
            for i in range(n)]


# Builds the built-in tiny model into WORKBENCH_HOME with the side's own code, untimed.
_WARM_MODEL = "from workbench.spec.models import resolve_model; resolve_model('builtin:tiny-llama')"


def _importable(tree: Path) -> Path:
    """A folder holding only a link to ``tree``'s package, for PYTHONPATH: the tree's root itself
    on sys.path would make its other top-level folders importable (kernels/, which transformers
    probes for in every process)."""
    shim = Path(tempfile.gettempdir()) / f"wb-bench-pkg-{abs(hash(str(tree)))}"
    shim.mkdir(exist_ok=True)
    link = shim / "workbench"
    if not link.exists():
        link.symlink_to(tree / "workbench", target_is_directory=True)
    return shim


def _run(label: str, package: Path, home: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(_importable(package)), "WORKBENCH_HOME": str(home),
           "HF_HUB_OFFLINE": "1"}
    spec = {**spec, "name": f"bench-{label}"}
    before = os.getloadavg()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=2400, cwd=str(home))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{label} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if Path(result["package"]).resolve() != (package / "workbench").resolve():
        raise RuntimeError(f"{label} imported {result['package']}, not {package}")
    out = {"label": label, **result, "load_avg_before": [round(x, 2) for x in before],
           "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-commit", default=OLD_COMMIT)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_start.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="wb-bench-data-"))
    old_tree = tmp / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree),
                    args.old_commit], check=True, capture_output=True)
    try:
        commit = subprocess.run(["git", "-C", str(old_tree), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        data = tmp / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _rows(args.rows)))
        spec = {"data": {"sources": [{"path": str(data)}], "max_length": 64},
                "train": {"max_steps": 1000, "batch_size": 8}}
        homes = {"old": tmp / "home-old", "new": tmp / "home-new"}
        for side, home in homes.items():
            home.mkdir()
            tree = old_tree if side == "old" else ROOT
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "workbench")],
                           check=True, capture_output=True)
            subprocess.run([sys.executable, "-c", _WARM_MODEL], check=True, capture_output=True,
                           cwd=str(home), env={**os.environ, "WORKBENCH_HOME": str(home),
                           "HF_HUB_OFFLINE": "1",
                           "PYTHONPATH": str(_importable(old_tree if side == "old" else ROOT))})
        runs = []
        for r in range(args.rounds):
            order = ["old", "cold", "cached"] if r % 2 == 0 else ["cached", "cold", "old"]
            for label in order:
                if label == "cold":  # an empty cache: this launch tokenises
                    shutil.rmtree(homes["new"] / "cache" / "tokenized", ignore_errors=True)
                if label == "cached" and not (homes["new"] / "cache" / "tokenized").is_dir():
                    _run("warm-up", ROOT, homes["new"], spec)  # fills the cache, not counted
                package = old_tree if label == "old" else ROOT
                runs.append({"round": r, **_run(label, package, homes[label if label == "old"
                                                                       else "new"], spec)})
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def median(label: str, key: str = "launch_to_first_step_s") -> float:
        return statistics.median(x[key] for x in runs if x["label"] == label)

    base = median("old")
    with_imports = {k: round(median(k, "with_imports_s"), 2) for k in ("old", "cold", "cached")}
    out = {"rows": args.rows, "processes": 2, "old_commit": commit, "rounds": args.rounds,
           "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs,
           "median_s": {k: round(median(k), 2) for k in ("old", "cold", "cached")},
           "cold_vs_old": round(median("cold") / base, 3),
           "cached_vs_old": round(median("cached") / base, 3),
           "median_with_imports_s": with_imports,
           "targets": {"cold_vs_old": 0.3, "cached_vs_old": 0.1}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
