"""Trainer callbacks that feed the run directory: metrics.jsonl and live progress in status.json.

Only global rank 0 writes, so the run directory has one writer per file whatever the world size.
"""

from __future__ import annotations

import os
import time
from typing import Any

from transformers import TrainerCallback

from workbench.runs.rundir import RUNNING, RunDir

# Trainer log keys -> metrics.jsonl keys (DESIGN.md: step, time, epoch, loss, lr, grad_norm, ...)
_RENAME = {"learning_rate": "lr"}
# The Trainer's end-of-training log carries train_loss; per-step logs never do.
_SUMMARY_KEY = "train_loss"
_SPEED_KEYS = ("train_runtime", "train_tokens_per_second")  # per-step noise, not metrics
# status.json (step, ETA, cost) is rewritten with fsync at most this often; metrics.jsonl gets
# every step at once. Rewriting it every step would slow a small model's run measurably
# (docs/benchmarks.md).
STATUS_EVERY_S = 0.5


# A hold file (HoldCallback): while the file this names exists, every rank waits before each step
# past the step number the file holds. Tests use it to act on a live run at a known step (kill
# a rank after a snapshot), whatever the machine's speed. Unset, no callback is added.
HOLD_ENV = "WORKBENCH_HOLD_FILE"


class BudgetSpentAtStart(Exception):
    """Raised on every rank in on_train_begin when the budget cannot pay for a step and a stop."""


class RunDirCallback(TrainerCallback):
    """Progress into status.json and metrics.jsonl (the bill is the supervisor's: budget.py)."""

    def __init__(self, run_dir: RunDir, world_size: int) -> None:
        self.rd = run_dir
        self.world_size = world_size
        self._last: tuple[float, int] | None = None  # (time, tokens seen) at the previous log
        self._t0 = time.time()
        self._first_step = 0
        self._status_at = 0.0
        self._pending: dict[str, Any] | None = None  # progress not yet in status.json
        self._bill: dict[str, Any] = {}  # the supervisor's attempt start and price (projection)
        self._paces: list[float] = []  # seconds per step between logs: the projection's range
        self._at: tuple[float, int] | None = None
        # (seconds since train begin, steps done) at this attempt's first log: the first step
        # warms up (allocations, lazy initialisation), so the pace is taken after it.
        self._first_log: tuple[float, int] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._first_step = state.global_step
        self._first_log = None
        if state.is_world_process_zero:
            self._t0 = time.time()
            self._last = (self._t0, state.num_input_tokens_seen or 0)
            self.rd.write_status(state=RUNNING, started=self._t0, total_steps=state.max_steps,
                                 step=state.global_step, world_size=self.world_size)
            self._bill = projection_basis(self.rd)
            self._at = (self._t0, state.global_step)
            earlier = self.rd.metrics_file.is_file() and self.rd.metrics_file.stat().st_size > 0
            if state.global_step > 0 or earlier:
                # Readers drop what an earlier attempt logged after this step (Job.metrics), also
                # when a resume without a snapshot starts over at step 0.
                self.rd.append_metrics({"event": "resume", "step": state.global_step,
                                        "time": self._t0})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kw: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        if _SUMMARY_KEY in logs:
            # An attempt that trained no step (resumed at the final step) has no loss of its
            # own: its 0.0 would replace the summary of the attempt that did the training.
            if state.global_step > self._first_step:
                self.rd.write_status(summary={k: v for k, v in logs.items() if k != "epoch"})
            return
        record: dict[str, Any] = {"step": state.global_step, "time": now}
        for key, value in logs.items():
            if key == "num_input_tokens_seen" or key in _SPEED_KEYS:
                continue
            record[_RENAME.get(key, key)] = value
        tokens = logs.get("num_input_tokens_seen")
        if tokens is not None and self._last is not None and "loss" in logs:
            t_prev, tok_prev = self._last
            if now > t_prev:
                record["tokens_per_s"] = (tokens - tok_prev) / (now - t_prev)
            record["tokens"] = tokens
            self._last = (now, tokens)
        self.rd.append_metrics(record)
        elapsed = now - self._t0
        step, total = state.global_step, state.max_steps
        done_here = step - self._first_step
        eta = elapsed / done_here * (total - step) if done_here > 0 else None
        # step_s lets the next attempt's budget check price its first step before taking it.
        step_s = elapsed / done_here if done_here > 0 else None
        self._pending = {"step": step, "total_steps": total, "eta_s": eta, "elapsed_s": elapsed,
                         "step_s": step_s, "last_loss": logs.get("loss"), "epoch": state.epoch}
        # Training lines only: a validation line's pass counts in the next step's pace.
        if "loss" in logs and done_here > 0:
            if self._first_log is None:
                self._first_log = (elapsed, done_here)
            elif done_here > self._first_log[1]:
                # The steady pace (after the first log) and what the first log took beyond it:
                # what the plan learns as step time and as the start-up's last part (history).
                e1, d1 = self._first_log
                pace = (elapsed - e1) / (done_here - d1)
                self._pending.update(pace_s=pace, first_step_extra_s=max(0.0, e1 - d1 * pace))
        if self._at is not None and step > self._at[1]:
            self._paces = [*self._paces[-19:], (now - self._at[0]) / (step - self._at[1])]
            self._at = (now, step)
        if step_s is not None and done_here >= 2:  # the first step compiles: not yet a pace
            self._pending.update(project(self._bill, now, step_s, self._paces, total - step))
        if now - self._status_at >= STATUS_EVERY_S or step >= total:
            self._flush_status(now)

    def _flush_status(self, now: float) -> None:
        if self._pending is not None:
            self.rd.write_status(**self._pending)
            self._pending, self._status_at = None, now

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Every rank: its peak memory so far (run.py records it again once all is saved), for
        # the plan's memory to be checked against (plan --check).
        record_peak_memory(self.rd, args.process_index)
        if state.is_world_process_zero:
            self._flush_status(time.time())


def peak_memory_gib() -> float:
    """This process's peak memory: what the CUDA allocator reserved on its GPU, else the
    process's peak resident memory (the host RAM a CPU rank held), in GiB."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_reserved()) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def record_peak_memory(rd: RunDir, rank: int) -> None:
    from workbench.runs.rundir import write_json_atomic

    rd.logs_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(rd.logs_dir / f"memory-rank-{rank}.json",
                      {"rank": rank, "peak_gib": peak_memory_gib(), "time": time.time()})


def projection_basis(rd: RunDir) -> dict[str, Any]:
    """What the live projection needs from status.json and the spec: the attempt's start, what
    earlier attempts billed, the price per hour and the budget limit."""
    try:
        status, spec = rd.status(), rd.spec()
    except Exception:  # no spec or status to read (a bare trainer in a test): no projection
        return {}
    return {"attempt_started": status.get("attempt_started"),
            "billed_before_s": status.get("billed_before_s") or 0.0,
            "price_per_hour": status.get("price_per_hour"),
            "currency": status.get("currency"), "limit": spec.budget.limit}


def project(basis: dict[str, Any], now: float, step_s: float, paces: list[float],
            remaining: int) -> dict[str, Any]:
    """status.json's projection: total seconds held and cost at the end, from the measured step
    time (range: the slowest and fastest pace between logs), and a warning once it passes the
    budget limit, well before the stop fires."""
    from workbench.runs.budget import RELEASE_S

    if basis.get("attempt_started") is None:
        return {}
    held = basis["billed_before_s"] + now - basis["attempt_started"] + RELEASE_S
    lo, hi = (min(paces), max(paces)) if paces else (step_s, step_s)
    out: dict[str, Any] = {
        "projected_total_s": held + step_s * remaining,
        "projected_total_range_s": [held + min(lo, step_s) * remaining,
                                    held + max(hi, step_s) * remaining]}
    price = basis.get("price_per_hour")
    if price:
        out["projected_cost"] = price * out["projected_total_s"] / 3600
        out["projected_cost_range"] = [price * t / 3600 for t in out["projected_total_range_s"]]
        limit = basis.get("limit")
        if limit is not None and out["projected_cost"] > limit:
            out["budget_warning"] = (
                f"projected cost {out['projected_cost']:.4g} {basis.get('currency') or ''} "
                f"(range {out['projected_cost_range'][0]:.4g}-{out['projected_cost_range'][1]:.4g})"
                f" passes the budget limit {limit:g}: the run will be stopped before its last "
                "step; raise budget.limit (job.resume(budget=...)) or lower train.max_steps")
        else:
            out["budget_warning"] = None
    return out


def _agree(flags: list[bool]) -> list[bool]:
    """Every rank takes a flag if any rank raised it (time-based decisions differ per rank, and
    ranks that disagree on stopping or saving would deadlock)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flags
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class SnapshotCallback(TrainerCallback):
    """When to snapshot (every N steps and/or M minutes) and the budget stop.

    How a snapshot is written and committed is SnapshottingTrainer's job (workbench.train.snapshotting).
    """

    def __init__(self, spec: Any, billing: Any, step_s: float | None = None) -> None:
        self.billing = billing
        self.step_s = step_s  # an earlier attempt's seconds per step, if it took any
        self.every_steps = spec.checkpoint.every_steps
        self.every_s = spec.checkpoint.every_minutes * 60 if spec.checkpoint.every_minutes else None
        self.last_snapshot = time.time()
        self.budget_stopped = False
        self._t0 = time.time()
        self._steps = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Before the first step: a budget that cannot pay a step and the stop after it ends the
        # attempt here, on every rank alike, instead of paying a step and a snapshot past it.
        self._t0 = self.last_snapshot = time.time()
        if self.billing.limit is not None:
            ahead = 2 * self.step_s if self.step_s else 0.0
            if _agree([self.billing.would_exceed(ahead)])[0]:
                raise BudgetSpentAtStart(f"{self.billing.cost():.4g} of {self.billing.limit:g} "
                                         f"{self.billing.currency} spent before the first step")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._steps += 1
        now = time.time()
        step_s = (now - self._t0) / self._steps
        save = bool(self.every_steps and state.global_step % self.every_steps == 0) or bool(
            self.every_s and now - self.last_snapshot >= self.every_s)
        # Stop while one more step (and the snapshot itself, about one step) still fits.
        stop = self.billing.would_exceed(2 * step_s)
        if self.every_s is not None or self.billing.limit is not None:
            # Clock-based decisions can differ between ranks; step-based ones cannot, so a
            # run without either skips this collective on every step.
            save, stop = _agree([save, stop])
        if stop and state.global_step < state.max_steps:
            self.budget_stopped = True
            control.should_training_stop = True
            save = True
        if save:
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.last_snapshot = time.time()


class HoldCallback(TrainerCallback):
    """Holds every rank before each step after step N while the hold file exists (HOLD_ENV).

    The file holds N as text; removing the file lets the ranks go on. Each rank waits on its
    own, so none enters the next step's collectives while the others wait.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        while True:
            try:
                with open(self.path) as fh:
                    after = int(fh.read().strip() or 0)
            except (FileNotFoundError, ValueError):
                return
            if state.global_step < after:
                return
            time.sleep(0.05)


def hold_callbacks() -> list[TrainerCallback]:
    """[HoldCallback] when the environment names a hold file (HOLD_ENV), else none."""
    path = os.environ.get(HOLD_ENV)
    return [HoldCallback(path)] if path else []
