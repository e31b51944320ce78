"""Trainer callbacks that feed the run directory: metrics.jsonl and live progress in status.json.

Only global rank 0 writes, so the run directory has one writer per file whatever the world size.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from workbench.rundir import RUNNING, RunDir

# Trainer log keys -> metrics.jsonl keys (DESIGN.md: step, time, epoch, loss, lr, grad_norm, ...)
_RENAME = {"learning_rate": "lr"}
# The Trainer's end-of-training log carries train_loss; per-step logs never do.
_SUMMARY_KEY = "train_loss"
_SPEED_KEYS = ("train_runtime", "train_tokens_per_second")  # per-step noise, not metrics


class RunDirCallback(TrainerCallback):
    def __init__(self, run_dir: RunDir, world_size: int) -> None:
        self.rd = run_dir
        self.world_size = world_size
        self._last: tuple[float, int] | None = None  # (time, tokens seen) at the previous log
        self._t0 = time.time()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self._t0 = time.time()
            self._last = (self._t0, state.num_input_tokens_seen or 0)
            self.rd.write_status(state=RUNNING, started=self._t0, total_steps=state.max_steps,
                                 step=state.global_step, world_size=self.world_size)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kw: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        if _SUMMARY_KEY in logs:
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
        eta = elapsed / step * (total - step) if step else None
        self.rd.write_status(step=step, total_steps=total, eta_s=eta, elapsed_s=elapsed,
                             last_loss=logs.get("loss"), epoch=state.epoch)
