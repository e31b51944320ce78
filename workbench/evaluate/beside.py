"""``eval.every_steps`` beside training: the snapshot scored in a process of its own.

Where the run's node has room the run does not use, global rank 0 writes the live weights (the
adapter, or the model, with the tokenizer) into ``eval/.weights-STEP`` and starts
``python -m workbench.evaluate.beside RUN_DIR STEP`` on that room, and training goes on at once:

- a GPU run: a CUDA device of this machine that no live run holds, leased
  (:mod:`workbench.targets.leases`) for the evaluation while rank 0 lives; under Slurm the job sees only
  the GPUs its ranks use, so there is none;
- a CPU run: the cores this process may run on beyond one per local rank (a 1-process run on a
  2-core machine has one); the evaluation's torch threads are limited to them.

Otherwise training pauses while rank 0 scores (:mod:`workbench.evaluate.callback`).
:func:`decide` says which and why; status.json's ``eval_every_steps`` records it. One evaluation
runs at a time: a snapshot due while the previous one is still scored waits for it (training
pauses for that wait), and the run waits for the last one before ``after`` and before it ends.
The child appends its lines to eval.jsonl and refreshes status.json (under its lock); a failure
goes to ``eval_error``, as in-run evaluation does, and the weights folder is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from workbench.runs.rundir import RunDir

# Set by the supervisor: the CUDA devices it could see before leasing the run's (comma list).
GPU_POOL_ENV = "WORKBENCH_GPU_POOL"
WEIGHTS = "eval/.weights-{step}"


@dataclass
class Room:
    """Where ``every_steps`` scores: ``beside`` (with the child's environment) or ``pause``."""

    mode: str
    reason: str
    env: dict[str, str] = field(default_factory=dict)
    lease_owner: str | None = None


def decide(run_id: str, gpus_per_node: int, local_ranks: int) -> Room:
    """Beside training where a spare GPU (GPU runs) or spare cores (CPU runs) exist."""
    if gpus_per_node:
        return _spare_gpu(run_id)
    cores = len(os.sched_getaffinity(0))
    spare = cores - local_ranks
    if spare < 1:
        return Room("pause", f"{cores} core(s), all used by the {local_ranks} rank process(es)"
                             " on this node: training pauses while rank 0 scores")
    return Room("beside", f"{spare} of {cores} core(s) spare beyond {local_ranks} rank "
                          "process(es): scored in a process of its own beside training",
                {"OMP_NUM_THREADS": str(spare), "CUDA_VISIBLE_DEVICES": ""})


def _spare_gpu(run_id: str) -> Room:
    from workbench.errors import ResourceError
    from workbench.runs.procs import ProcessIdentity
    from workbench.targets import leases

    pool = [d for d in os.environ.get(GPU_POOL_ENV, "").split(",") if d]
    if not pool:
        return Room("pause", "no GPU beyond the run's own is visible here (under Slurm the job "
                             "has only its ranks' GPUs): training pauses while rank 0 scores")
    owner = f"{run_id}.eval"
    try:
        got = leases.acquire(owner, 1, ProcessIdentity.me("eval", 0), devices=pool)
    except ResourceError:
        return Room("pause", f"every GPU of {','.join(pool)} is held by this run or another: "
                             "training pauses while rank 0 scores")
    return Room("beside", f"GPU {got[0]} is free (not leased to this run): scored there in a "
                          "process of its own beside training",
                {"CUDA_VISIBLE_DEVICES": got[0]}, lease_owner=owner)


class Beside:
    """Rank 0's handle on the evaluation process (at most one at a time)."""

    def __init__(self, rd: RunDir, room: Room, tasks: list[Any], tokenizer: Any,
                 base_id: str) -> None:
        self.rd, self.room, self.tasks = rd, room, tasks
        self.tokenizer, self.base_id = tokenizer, base_id
        self.proc: subprocess.Popen | None = None

    def start(self, model: Any, step: int) -> None:
        self.wait()
        folder = self.rd.path / WEIGHTS.format(step=step)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))
        (folder / "workbench.json").write_text(json.dumps({"base_model_id": self.base_id}))
        (folder / "tasks.json").write_text(json.dumps([t.model_dump() for t in self.tasks]))
        from workbench.runs import procs

        env = {**os.environ, **self.room.env, "PYTHONUNBUFFERED": "1"}
        with (self.rd.logs_dir / "eval-beside.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workbench.evaluate.beside", str(self.rd.path), str(step)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.rd.path, preexec_fn=procs.die_with_parent)
        print(f"eval: during at step {step}: scoring beside training (pid {self.proc.pid})",
              flush=True)

    def wait(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            print(f"eval: waiting for the evaluation beside training (pid {self.proc.pid})",
                  flush=True)
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.wait()
        if self.room.lease_owner:
            from workbench.runs.procs import ProcessIdentity
            from workbench.targets import leases

            leases.release(self.room.lease_owner, ProcessIdentity.me("eval", 0))


def main(argv: list[str] | None = None) -> int:
    """The evaluation process: score ``eval/.weights-STEP`` of RUN_DIR as phase ``during``."""
    run_dir, step_text = (argv if argv is not None else sys.argv[1:])[:2]
    rd, step = RunDir(run_dir), int(step_text)
    folder = rd.path / WEIGHTS.format(step=step)
    started = time.time()
    try:
        import torch

        from workbench.evaluate.runner import as_tasks, score
        from workbench.evaluate.sources import open_weights

        if os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        tasks = as_tasks(json.loads((folder / "tasks.json").read_text()))
        validation = rd.data_dir / "validation.jsonl"
        source = open_weights(folder, label="run")
        report = score(source, tasks, phase="during", step=step, run_dir=rd.path,
                       default_file=validation if validation.is_file() else None)
        print(f"eval: during at step {step} (beside, {time.time() - started:.1f} s): "
              f"{report.metrics}", flush=True)
        return 0
    except Exception as exc:  # the run matters more than one evaluation: record, go on
        traceback.print_exc()
        rd.write_status(eval_error=f"during at step {step}: {exc}")
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
