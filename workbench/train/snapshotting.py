"""The Trainer class a rank trains with: the Trainer (or a TRL trainer) whose snapshots are
written asynchronously and committed as verified step-N folders of the run directory
(:mod:`workbench.runs.snapshots`), and which resumes cleanly from a snapshot of the final step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.runs.rundir import RunDir


def snapshotting_trainer_class(base: type | None = None) -> type:
    """The Trainer (or ``base``, a TRL trainer), with snapshots committed as verified step-N
    folders (asynchronously)."""
    import time

    from transformers import Trainer

    from workbench.runs.snapshots import commit, record_error
    from workbench.train.async_snapshot import AsyncWriter, wait_for_ranks
    from workbench.train.callbacks import barrier

    class SnapshottingTrainer(base or Trainer):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, run_dir: RunDir, keep: int, uploader: Any = None,
                     billing: Any = None, optimizer_in_backward: bool = False,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rd, self.keep, self.uploader, self.billing = run_dir, keep, uploader, billing
            self.writer = AsyncWriter(self.args.process_index)
            self.in_backward: bool = optimizer_in_backward
            if optimizer_in_backward and (self.args.max_grad_norm
                                          or self.args.gradient_accumulation_steps > 1):
                raise ValueError("the optimizer in backward steps each gradient as it arrives: "
                                 "it needs max_grad_norm 0 and gradient_accumulation_steps 1")

        def create_optimizer(self, model: Any = None) -> Any:
            """The Trainer's optimizer, or with the optimizer in backward one per parameter
            (workbench.train.in_backward) of the Trainer's class, arguments and decay groups."""
            current: Any = getattr(self, "optimizer", None)
            if not self.in_backward or current is not None:
                return super().create_optimizer(model)
            from workbench.train.in_backward import InBackwardOptimizer

            target = self.model if model is None else model
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, target)
            built = InBackwardOptimizer(target, cls, kwargs,
                                        set(self.get_decay_parameter_names(target)),
                                        self.args.weight_decay)
            print(f"optimizer in backward: {len(built.optimizers)} parameters, each stepped by "
                  f"its own {cls.__name__} as its gradient arrives", flush=True)
            self.optimizer = built
            return built

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            if self.in_backward and grad_norm is None:  # gradients are gone: the hooks' sum
                wrapped: Any = getattr(self, "optimizer", None)
                inner = getattr(wrapped, "optimizer", wrapped)  # inside accelerate's wrapper
                return inner.take_grad_norm()
            return super()._get_grad_norm(model, grad_norm)

        def _init_training_state(self, max_steps: int, per_epoch: int, epochs: int,
                                 resume_from: str | None, trial: Any) -> tuple[int, int]:
            epochs_trained, skip = super()._init_training_state(max_steps, per_epoch, epochs,
                                                                resume_from, trial)
            if self.state.global_step >= max_steps:
                # Resumed from a snapshot taken at the final step. The Trainer checks for the end
                # only after a step, so it would train one more (step N+1 of N at lr 0); with no
                # epoch left, it goes straight to its normal end, the snapshot's weights loaded.
                print(f"resumed at the final step {self.state.global_step}: nothing left to "
                      "train", flush=True)
                return epochs, 0
            return epochs_trained, skip

        def _commit(self, folder: Path, step: int, stall_s: float, started: float) -> None:
            prefix = str(folder) + os.sep
            known = {k[len(prefix):]: self.writer.hashes.pop(k)
                     for k in list(self.writer.hashes) if k.startswith(prefix)}
            final = commit(self.rd, folder, step, self.keep, known, self.uploader)
            info: dict[str, Any] = {
                "step": step, "path": final.name, "stall_s": round(stall_s, 4),
                "write_s": round(time.time() - started, 4), "time": time.time()}
            self.rd.write_status(snapshot=info)
            self.rd.append_metrics({"event": "snapshot", **info})
            if self.billing is not None:
                self.billing.shutdown_s = max(self.billing.shutdown_s, info["write_s"] + 1.0)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            step = self.state.global_step
            folder = Path(str(self.args.output_dir)) / f"checkpoint-{step}"  # always set: ours
            started = time.time()
            if self.is_deepspeed_enabled:  # the engine writes its own shards: synchronous
                super()._save_checkpoint(model, trial)
                barrier()
                if self.is_world_process_zero():
                    self._commit(folder, step, time.time() - started, started)
                barrier()
                return
            with self.writer.capture():
                super()._save_checkpoint(model, trial)
            copies = self.writer.current
            then = on_error = None
            if self.is_world_process_zero():
                # Every rank of the world writes into a shared folder: all of them, not only
                # this node's, must be done before the manifest says it is complete. Where the
                # nodes share no folder (WORKBENCH_OWN_FOLDER), only this node's ranks write here:
                # the snapshot holds their files, and a resume on the other nodes starts from
                # storage without their own RNG state (the Trainer warns and goes on).
                own = os.environ.get("WORKBENCH_OWN_FOLDER") == "1"
                world = range(int(os.environ.get("LOCAL_WORLD_SIZE" if own else "WORLD_SIZE",
                                                 "1")))

                def then() -> None:  # stall: the save, and the next optimizer step's wait
                    wait_for_ranks(folder, world)
                    self._commit(folder, step, copies.stall_s if copies else 0.0, started)

                def on_error(exc: BaseException) -> None:
                    record_error(self.rd, step, "write", exc)

            self.writer.flush_async(folder, then, on_error)

    return SnapshottingTrainer
