"""Planned against measured: every ended run's record, and the correction the planner learns.

When a run ends, :func:`record_run` reads what its plan said (plan.json's ``clock``) and what the
run did (status.json: supervisor start, first step, last step, bill), gives the supervisor
``measured`` for status.json's last write and appends one line to
``WORKBENCH_HOME/calibration/runs.jsonl``. :func:`correction` gives the planner the median ratio
measured / modelled of the nearest earlier runs (same target, device, model shape, method and world
size; without any, of other model shapes nearest in size) for step time and start-up, and the
median finish (last step to the end) of runs of the same shape.
:func:`check_report` is ``workbench plan --check RUN``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NEAREST = 5  # earlier runs a correction is taken from (the newest of the nearest)


def runs_file() -> Path:
    from workbench.plan.calstore import calibration_dir

    return calibration_dir() / "runs.jsonl"


def measured(plan: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """What the run's last attempt measured, beside what its plan said; None before a step."""
    clock = plan.get("clock") or {}
    step_s, started, first = status.get("step_s"), status.get("attempt_started"), \
        status.get("started")
    if not step_s or started is None or first is None:
        return None
    steps_done = (status.get("step") or 0)
    total = (status["ended"] - started) if status.get("ended") else None
    finish = total - (first - started) - (status.get("elapsed_s") or 0.0) if total else None
    # The steady pace after the first logged step, and the first step's warm-up beyond it as the
    # start-up's last part: status.json's step_s (elapsed / steps) carries the warm-up into every
    # step, and a correction learnt from a short run then over-planned a longer or wider one.
    # A status.json without the pace gives step_s and no warm-up.
    pace = status.get("pace_s") or step_s
    warm = (status.get("first_step_extra_s") or 0.0) if status.get("pace_s") else 0.0
    out: dict[str, Any] = {
        "startup_s": max(0.0, first - started) + warm,
        "finish_s": max(0.0, finish) if finish is not None else None,
        "step_s": pace,
        "steps": steps_done,
        "total_s": total,
        "billed_s": status.get("billed_s"), "cost": status.get("cost"),
        "tokens_per_s": (plan["tokens_per_step"] / pace if plan.get("tokens_per_step")
                         else None),
        "planned_step_s": clock.get("step_s"), "planned_startup_s": clock.get("startup_s"),
        "planned_total_s": clock.get("total_s"), "planned_cost": plan.get("cost"),
    }
    return out


def record_run(rd: Any, final: dict[str, Any]) -> dict[str, Any] | None:
    """Append the run's record and return status.json's ``measured`` (the supervisor writes it
    with ``final``, its last status fields); None when the plan has no clock or the run took no
    step."""
    try:
        plan = json.loads(rd.plan_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    clock = plan.get("clock")
    status = {**rd.status(), **final}
    m = measured(plan, status)
    if not clock or m is None:
        return None
    # A sweep trial shared the cores with the trials beside it (workbench.sweep.budget.sharing):
    # the next plan learns the pace of the run alone, and a sweep multiplies it again.
    alone = float((status.get("sweep") or {}).get("sharing") or 1.0)
    finish = _finish_alone(rd, m["finish_s"])
    row = {k: clock.get(k) for k in ("target", "device", "shape", "method", "world_size")}
    row.update(run=rd.path.name, model_step_s=clock.get("model_step_s"),
               model_eval_s=clock.get("model_eval_s"), planned_steps=clock.get("steps"),
               model_startup_s=clock.get("model_startup_s"), measured_step_s=m["step_s"] / alone,
               measured_startup_s=m["startup_s"] / alone,
               finish_s=finish / alone if finish is not None else None,
               planned_step_s=clock.get("step_s"),
               planned_startup_s=clock.get("startup_s"), steps=m["steps"])
    peak = peak_memory(rd)
    if peak is not None:
        m["peak_memory_gib"] = peak
        m["planned_memory_gib"] = (plan.get("memory_gib") or {}).get("total")
        row.update(peak_memory_gib=peak, planned_memory_gib=m["planned_memory_gib"])
    with runs_file().open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
    return m


def _finish_alone(rd: Any, finish: float | None) -> float | None:
    """The finish less what the plan counts apart: the ``after`` scoring eval.jsonl timed
    (clock.scoring_s) and the validation pass logged after the last step (clock.eval_s counts
    the one at the end), so the learnt finish carries neither a second time."""
    if finish is None:
        return None
    from workbench.evaluate import results

    try:
        scored = sum(float(ln.get("seconds") or 0.0) for ln in results.read(rd.path)
                     if ln.get("phase") == "after")
    except (OSError, ValueError, TypeError):
        scored = 0.0
    rows = rd.metrics()
    last_step = max((r["time"] for r in rows if "loss" in r and "time" in r), default=None)
    validated = sum(float(r.get("eval_runtime") or 0.0) for r in rows if "eval_loss" in r
                    and last_step is not None and r.get("time", 0.0) >= last_step)
    return max(0.0, finish - scored - validated)


def peak_memory(rd: Any) -> float | None:
    """The largest peak memory (GiB) any rank of the run recorded at the end of training
    (RUN_DIR/logs/memory-rank-N.json: GPU memory reserved, or a CPU rank's resident memory)."""
    peaks = []
    for path in sorted(Path(rd.logs_dir).glob("memory-rank-*.json")):
        try:
            peaks.append(float(json.loads(path.read_text(encoding="utf-8"))["peak_gib"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed while writing: the others still say
    return max(peaks) if peaks else None


@dataclass(frozen=True)
class Correction:
    step: float  # multiply the modelled step time by this
    startup: float  # and the modelled start-up by this
    # Seconds from the last step to the end (save, exit) of earlier runs of this very shape;
    # None from other shapes (they save other weights: the planner models it).
    finish: float | None
    runs: int  # how many earlier runs it is taken from
    names: tuple[str, ...] = ()  # their run folders, oldest first
    # The model shapes of those runs when none was of the planned shape (their ratio measured /
    # modelled scaled to this shape by the FLOPs model); empty: runs of this very shape.
    shapes: tuple[str, ...] = ()

    def line(self, target: str) -> str:
        """The plan's assumption line: what the estimate was corrected from, and by how much."""
        newest = f", newest {self.names[-1]}" if self.names else ""
        how = (f"scaled by the FLOPs model from {self.runs} earlier run(s) of another model "
               f"shape ({', '.join(self.shapes)})" if self.shapes else
               f"corrected from {self.runs} earlier run(s)")
        return (f"{how} on {target}{newest}: step time x{self.step:.2f}, start-up "
                f"x{self.startup:.2f} (measured / modelled)")


def _params(shape: Any) -> float:
    """The parameter count in a shape key ``model_id:params`` (0 when it has none)."""
    try:
        return float(str(shape).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0.0


def correction(target: str, device: str, shape: str, method: str,
               world_size: int) -> Correction | None:
    """Median measured / modelled ratios of the newest earlier runs of the same target, device,
    shape, method and world size; without any, of the runs of the other model shape nearest in
    parameter count (same target, device, method and world size): a ratio measured / modelled is
    what the FLOPs/tokens model missed on that device, so it carries to another shape, sequence
    length or batch. None without any. Other world sizes are not used: on CPU one process trains
    with every core's threads and two with one each, and their step times are far apart
    (docs/planning.md)."""
    try:
        lines = runs_file().read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    same: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a torn last line of a run killed while appending
        if (isinstance(r, dict) and (r.get("target"), r.get("device"), r.get("method"),
                                     r.get("world_size")) == (target, device, method, world_size)
                and r.get("model_step_s") and r.get("measured_step_s")):
            (same if r.get("shape") == shape else other).append(r)
    if same:
        near = same[-_NEAREST:]
    elif other:
        # The runs of the one shape nearest in size (the newest such shape among equals): a far
        # shape's ratio (other kernels, other overheads) would only blur it.
        size = max(_params(shape), 1.0)
        nearest = min(reversed(other), key=lambda r: abs(
            math.log(max(_params(r.get("shape")), 1.0) / size))).get("shape")
        near = [r for r in other if r.get("shape") == nearest][-_NEAREST:]
    else:
        return None

    def modelled(r: dict[str, Any]) -> float:
        # status.json's step_s is training time per step, validation passes included: compare
        # it with the modelled step plus its share of the modelled validation.
        per_step = (r.get("model_eval_s") or 0.0) / r["planned_steps"] if r.get(
            "planned_steps") else 0.0
        return float(r["model_step_s"]) + per_step

    step = statistics.median(r["measured_step_s"] / modelled(r) for r in near)
    ups = [r["measured_startup_s"] / r["model_startup_s"] for r in near
           if r.get("model_startup_s") and r.get("measured_startup_s") is not None]
    ends = [r["finish_s"] for r in near if r.get("finish_s") is not None]
    return Correction(step, statistics.median(ups) if ups else 1.0,
                      statistics.median(ends) if ends and same else None, len(near),
                      tuple(str(r.get("run")) for r in near if r.get("run")),
                      () if same else tuple(dict.fromkeys(str(r.get("shape")) for r in near)))


def _fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "-"
    return f"{v:,.4g} {unit}".strip()


def check_report(rd: Any) -> str:
    """Planned against measured for one run (``workbench plan --check RUN``)."""
    from workbench.errors import WorkbenchError

    try:
        plan = json.loads(rd.plan_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkbenchError(f"run {rd.path.name} has no readable plan.json ({exc}): it was "
                             "launched without a plan, so there is nothing to check") from exc
    status = rd.status()
    m = status.get("measured") or measured(plan, status)
    if m is None:
        raise WorkbenchError(f"run {rd.path.name} has not finished a step yet (state "
                             f"{status.get('state')}): check again once it has")
    if not plan.get("clock"):
        raise WorkbenchError(f"run {rd.path.name} was planned before plans kept their clock: "
                             "re-plan its spec (`workbench plan SPEC`) to compare")
    cur = plan.get("currency") or ""
    rows = [("start-up", m["planned_startup_s"], m["startup_s"], "s"),
            ("step", m["planned_step_s"], m["step_s"], "s"),
            ("total (start to end)", m["planned_total_s"], m["total_s"], "s"),
            ("cost", m["planned_cost"], m["cost"], cur)]
    peak = m.get("peak_memory_gib") or peak_memory(rd)
    if peak is not None:
        rows.append(("peak memory / process", (plan.get("memory_gib") or {}).get("total"), peak,
                     "GiB"))
    lines = [f"Run {rd.path.name} ({status.get('state')}, {m['steps']} steps): planned -> "
             "measured"]
    for name, p, a, unit in rows:
        err = f"  ({(p - a) / a:+.0%} planned vs measured)" if p and a else ""
        lines.append(f"  {name:<22}{_fmt(p, unit):>14} -> {_fmt(a, unit):<14}{err}")
    basis = plan.get("clock", {}).get("basis")
    if basis:
        lines.append(f"  basis: {basis}")
    return "\n".join(lines)
