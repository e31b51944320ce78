"""The first plan on a fresh machine (issue 37): from an empty WORKBENCH_HOME, the first plan of
the built-in tiny model on 2 processes must hold the step the run then really takes, measured by
the run itself (the interval between its metrics.jsonl steps), not by the planner's formula.

The plan's range is what the planner promises on a machine whose load stays as it was at the
plan; on this shared 2-core VM the real step of the same run moved between 42 and 93 ms at the
same load average within minutes (docs/planning.md, "the first plan on a fresh home"), so the test
allows a factor of ``SLACK`` beyond the range's ends: the first plans before the bare step was
timed were 0.19x and 2.84x the real step (outside even that), and bench/bench_plan_accuracy.py
holds the range itself on an idle machine."""

from __future__ import annotations

import statistics

import workbench
from workbench.plan import plan
from workbench.plan.firststep import TOLERANCE

SLACK = 2.0  # how far beyond the plan's range another process's load may push the real step


def _median_step(job) -> float:
    """The run's own step: the median interval between consecutive logged training steps, the
    first step (warm-up) and any holding a validation pass left out."""
    rows = job.run_dir.metrics()
    steps = [r for r in rows if "loss" in r and "step" in r and "eval_loss" not in r]
    evals = [r["time"] for r in rows if "eval_loss" in r]
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"])
            for a, b in zip(steps, steps[1:], strict=False)
            if a["step"] >= 1 and b["step"] > a["step"]
            and not any(a["time"] < t <= b["time"] for t in evals)]
    assert len(gaps) >= 20, f"too few steps logged to measure the run's pace: {len(gaps)}"
    return statistics.median(gaps)


def test_the_first_plan_of_a_fresh_home_holds_the_real_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    spec = workbench.RunSpec(name="first-plan", train={"max_steps": 80, "eval_every": 0},
                             resources={"processes_per_node": 2})
    clock = plan(spec).clock
    assert clock is not None and clock["step_s"] > 0
    # A plan that gives no range is held to the tolerance around its step.
    low, high = clock.get("step_range_s") or (clock["step_s"] * (1 - TOLERANCE),
                                              clock["step_s"] * (1 + TOLERANCE))
    job = workbench.launch(spec)
    assert job.wait(progress=False, poll=0.5) == "succeeded"
    real = _median_step(job)
    assert low / SLACK <= real <= high * SLACK, (
        f"the first plan's step {clock['step_s'] * 1e3:.1f} ms (range {low * 1e3:.1f}-"
        f"{high * 1e3:.1f} ms) is more than x{SLACK:g} from the run's real median step {real * 1e3:.1f} ms; "
        f"plan's basis: {clock['basis']}")
