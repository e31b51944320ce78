"""Evaluation inside the training run: ``eval.before`` / ``every_steps`` / ``after`` on its target.

Global rank 0 scores the live weights in place (eval mode, no gradients, then back to training)
while the other ranks wait at a barrier, so the time is spent on resources the run already holds
and bills. The random state of every generator training draws from (Python, NumPy, torch CPU and
CUDA) is put back afterwards, and nothing touches the optimizer or the data order: the loss
curve is the one the run would have had without evaluation.

``every_steps`` scores beside training instead, in a process of its own on a snapshot of the
weights, where the node has a spare GPU or spare cores (:mod:`workbench.evaluate.beside`); the
choice and its reason are in status.json's ``eval_every_steps``.

A failing evaluation (an unreachable judge, an unknown lm-eval task) is written to status.json's
``eval_error`` and the rank-0 log; training goes on. Under ZeRO-3 the weights are partitioned
over the ranks, so in-run evaluation is skipped with a note: score the run afterwards with
``job.evaluate()``. Evaluation stops where the budget does: none after a budget stop, and none
whose expected length (the previous evaluation's) would pass ``budget.limit``.
"""

from __future__ import annotations

import json
import random
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from workbench.evaluate import results
from workbench.runs.rundir import RunDir


@contextmanager
def _rng_kept() -> Any:
    import numpy as np
    import torch

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class EvalCallback(TrainerCallback):
    """Runs the spec's eval tasks at the points ``spec.eval`` names (see module docstring)."""

    def __init__(self, run_dir: RunDir, spec: Any, tokenizer: Any, billing: Any = None,
                 snapshots: Any = None) -> None:
        self.rd, self.spec, self.tokenizer = run_dir, spec, tokenizer
        self.billing, self.snapshots = billing, snapshots  # the budget: see _affordable
        self.last_s = 0.0  # how long the previous evaluation took: the next one's estimate
        self.cfg = spec.eval
        validation = run_dir.data_dir / "validation.jsonl"
        # validation_fraction 0 still writes the split, empty: that is no split to score.
        self.default_file = validation if _has_rows(validation) else None
        self.tasks = _fitting(self.cfg.tasks, self.default_file)
        self.beside: Any = None  # a workbench.evaluate.beside.Beside on rank 0 when there is room
        self.beside_all = False  # every rank: every_steps scores beside (no barrier)

    def _active(self) -> bool:
        from transformers.integrations import is_deepspeed_zero3_enabled

        if not self.tasks:
            return False
        if is_deepspeed_zero3_enabled():
            print("eval: skipped in-run evaluation under ZeRO-3 (weights are partitioned); "
                  "score the run afterwards with job.evaluate()", flush=True)
            return False
        return True

    def _affordable(self, phase: str) -> bool:
        """Evaluation is held-resource time: skip it once the budget stopped training, or when
        the last evaluation's length would pass the limit (decided alike on every rank)."""
        if self.snapshots is not None and self.snapshots.budget_stopped:
            return False
        if self.billing is None or self.billing.limit is None:
            return True
        if _agree_flag(self.billing.would_exceed(self.last_s)):
            print(f"eval: {phase} skipped: it would pass budget.limit", flush=True)
            return False
        return True

    def _evaluate(self, state: Any, model: Any, phase: str) -> None:
        import time

        from workbench.train.callbacks import barrier

        if not self._affordable(phase):
            return
        started = time.time()
        if state.is_world_process_zero:
            self._score(model, phase, state.global_step)
        barrier()  # the other ranks wait here, not inside the next step's all-reduce
        self.last_s = time.time() - started

    def _score(self, model: Any, phase: str, step: int) -> None:
        from workbench.evaluate.runner import score
        from workbench.evaluate.sources import TransformersSource
        from workbench.spec.models import resolve_model

        label = "base" if phase == "before" else "run"
        source = TransformersSource(model, self.tokenizer, label,
                                    base_id=resolve_model(self.spec.model.id),
                                    batch_size=self.spec.train.batch_size)
        print(f"eval: {phase} at step {step}: {[t.kind for t in self.tasks]}", flush=True)
        try:
            with _rng_kept():
                report = score(source, self.tasks, phase=phase, step=step, run_dir=self.rd.path,
                               default_file=self.default_file)
            print(f"eval: {phase} at step {step}: {report.metrics}", flush=True)
        except Exception as exc:  # the run matters more than one evaluation: record, go on
            traceback.print_exc()
            self.rd.write_status(eval_error=f"{phase} at step {step}: {exc}")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kw: Any) -> None:
        if self.cfg.every_steps and self.tasks:
            self._place_every_steps(state)
        if not self.cfg.before or not self._active():
            return
        # A resumed run scored its base already (the eval.jsonl line is there).
        done = any(ln.get("phase") == "before" for ln in results.read(self.rd.path))
        if state.global_step == 0 and not _agree_flag(done):
            self._evaluate(state, model, "before")

    def _place_every_steps(self, state: Any) -> None:
        """Beside or pause: rank 0 decides (its node's room), every rank follows."""
        import os

        from transformers.integrations import is_deepspeed_zero3_enabled

        room = None
        if state.is_world_process_zero and not is_deepspeed_zero3_enabled():
            from workbench.evaluate.beside import decide

            room = decide(self.rd.path.name, self.spec.resources.gpus_per_node,
                          int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            self.rd.write_status(eval_every_steps={"mode": room.mode, "reason": room.reason})
            print(f"eval: every {self.cfg.every_steps} steps: {room.mode} ({room.reason})",
                  flush=True)
        self.beside_all = _agree_flag(room is not None and room.mode == "beside")
        if room is not None and self.beside_all:
            from workbench.evaluate.beside import Beside

            self.beside = Beside(self.rd, room, self.tasks, self.tokenizer, self.spec.model.id)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kw: Any) -> None:
        every = self.cfg.every_steps
        step = state.global_step
        if not every or step % every or (self.cfg.after and step >= state.max_steps):
            return  # the last step is scored by ``after``
        if not self._active():
            return
        if not self.beside_all:
            self._evaluate(state, model, "during")
        elif self._affordable("during") and self.beside is not None:  # every rank asks
            self.beside.start(model, step)  # rank 0 only; the others go on training

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None,
                     **kw: Any) -> None:
        if self.beside is not None:
            self.beside.close()  # its lines are in eval.jsonl before ``after`` writes there
        if self.cfg.after and self._active():
            self._evaluate(state, model, "after")


def _has_rows(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open(encoding="utf-8") as fh:
        return any(line.strip() for line in fh)


def _fitting(tasks: list[Any], validation: Path | None) -> list[Any]:
    """The tasks this run can score: those that need the validation split are dropped when the
    run has none, and a heldout on plain-text rows (no answers to compare) becomes perplexity."""
    out = []
    for task in tasks:
        if task.kind == "lm_eval" or task.file:
            out.append(task)
        elif validation is None:
            print(f"eval: no validation split (data.validation_fraction 0): {task.kind} skipped; "
                  "give it a file:", flush=True)
        elif task.kind == "heldout" and not _is_chat(validation):
            out.append(task.model_copy(update={"kind": "perplexity"}))
        else:
            out.append(task)
    return out


def _is_chat(path: Path) -> bool:
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        return "messages" in json.loads(first)
    except ValueError:
        return False


def _agree_flag(flag: bool) -> bool:
    """Rank 0's reading of eval.jsonl, shared with every rank (only it may have the file)."""
    from workbench.train.callbacks import _agree

    return _agree([flag])[0]
