"""One training process: read RUN_DIR, build model + tokenizer + data, run the Trainer, save artefacts.

Every rank runs this (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE). It is deliberately one
readable function per stage, in the order a reader expects: logs, spec, tokenizer, model, data,
trainer, save. The pieces it puts together live beside it: the model (model.py), the Trainer's
arguments (arguments.py) and the Trainer class that commits snapshots (snapshotting.py).
Terminal states (succeeded / failed / cancelled) are written by the supervisor that started the
ranks, because only it sees every rank's exit.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

from workbench.data.tokenize import load_tokenizer
from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec
from workbench.train.arguments import training_arguments
from workbench.train.fastpath import applied_line
from workbench.train.model import load_model
from workbench.train.snapshotting import snapshotting_trainer_class


def _redirect_output(rd: RunDir, rank: int) -> None:
    # One log file per rank, the same on every backend: the run directory is all a reader needs.
    rd.logs_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(rd.logs_dir / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _startup(stage: str) -> None:
    """Log how long after this process started a start-up stage ended, and the CPU seconds it
    had used by then (where launch -> first step goes: see docs/benchmarks-data.md; on a loaded
    machine the CPU seconds say more than the wall clock)."""
    import time

    import psutil

    now, cpu = time.time(), time.process_time()
    # CPU seconds (what a rank gets of the busy cores it shares) and the clock time, so the
    # ranks' stages line up with the supervisor's attempt_started.
    print(f"startup: {stage} at {now - psutil.Process().create_time():.2f} s "
          f"(cpu {cpu:.2f} s, t={now:.2f})", flush=True)

def load_split(rd: RunDir, split: str, tokenizer: Any, spec: RunSpec) -> Any:
    """The split's tokenised rows: the Arrow files launch wrote (memory-mapped, shared by every
    rank), or, where launch did not tokenise (it could not load the tokenizer), the jsonl
    tokenised here. Validation is cut to data.eval_samples (the same deterministic sample on
    every rank)."""
    from workbench.data.tokenized import eval_sample, load_tokenized, tokenize_split

    rows = load_tokenized(rd.data_dir, split)
    if rows is not None:
        files = sorted(p.name for p in (rd.data_dir / "tokenized" / split).glob("*.arrow"))
        print(f"data: {split} loaded {len(rows)} rows memory-mapped from "
              f"{rd.data_dir / 'tokenized' / split} {files}", flush=True)
    else:
        import datasets

        path = rd.data_dir / f"{split}.jsonl"
        table, _stats = tokenize_split(path, spec, tokenizer, split=split)
        rows = datasets.Dataset(table)
        print(f"data: {split} tokenised {len(rows)} rows from {path} in this rank", flush=True)
    if split == "validation":
        rows = eval_sample(rows, spec.data.eval_samples, spec.train.seed)
    return rows


def save_artefacts(trainer: Any, tokenizer: Any, spec: RunSpec, rd: RunDir, source: str) -> Path:
    out = rd.adapter_dir if spec.method.kind in ("lora", "qlora") else rd.model_dir
    trainer.save_model(str(out))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(str(out))
        (out / "workbench.json").write_text(json.dumps({
            "base_model": source, "base_model_id": spec.model.id, "method": spec.method.kind,
            "stage": spec.method.stage,
            "lora_r": spec.method.lora_r if spec.method.kind != "full" else None,
        }, indent=1))
    return out


def main(run_dir: str) -> int:
    rd = RunDir(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _redirect_output(rd, rank)
    print(f"workbench.train rank {rank}/{world} pid {os.getpid()} run {rd.path}", flush=True)
    from workbench.runs import procs

    procs.watch_supervisor()  # a rank ends with its supervisor, even one killed -9
    procs.record(rd, procs.ProcessIdentity.me("rank", rank))

    from workbench.data.tokenize import Collator
    from workbench.evaluate.callback import EvalCallback
    from workbench.runs.budget import Billing
    from workbench.runs.snapshots import Uploader, agreed_resume_point, newest_verified, storage_prefix
    from workbench.spec.models import resolve_model, trainer_path
    from workbench.train.callbacks import BudgetSpentAtStart, RunDirCallback, SnapshotCallback, hold_callbacks
    from workbench.train.preload import import_training_libraries, imports_done

    import_training_libraries()  # done already in a standby rank
    print(imports_done(), flush=True)
    _startup("imports")
    spec = rd.spec()
    if rank == 0:
        for stale in (rd.path / "checkpoints").glob("checkpoint-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a snapshot a crash left half-written
    source = resolve_model(spec.model.id)
    stage: Any = None  # workbench.train.preference (a non-SFT stage) or .vision (an image model)
    path = trainer_path(spec)
    if path == "preference":  # dpo/orpo/kto/grpo: TRL's trainers, the same path otherwise
        from workbench.train import preference as stage
    elif path == "vision":
        from workbench.train import vision as stage
    # A vision run's "tokenizer" is its processor: it batches, and is saved beside the adapter.
    tokenizer = (stage.load_processor(spec, source) if hasattr(stage, "load_processor")
                 else load_tokenizer(spec, source))
    _startup("tokenizer")
    from transformers import set_seed

    set_seed(spec.train.seed)  # before the LoRA init, so the same spec trains the same way
    train_rows = stage.load_rows(rd, "train") if stage else load_split(rd, "train", tokenizer, spec)
    eval_rows = (stage.load_rows(rd, "validation") if stage
                 else load_split(rd, "validation", tokenizer, spec))
    _startup("data")
    # The arguments (and with them the DeepSpeed config) before the model: under ZeRO-3,
    # from_pretrained then builds each layer already partitioned (deepspeed.zero.Init), so no rank
    # ever holds the whole model. `args` stays alive to the end, and so does the config.
    args = (stage.arguments(spec, rd, len(eval_rows) > 0, training_arguments) if stage
            else training_arguments(spec, rd, has_eval=len(eval_rows) > 0))
    if args.deepspeed:
        # Join the process group now, and let DeepSpeed's comm wrap it (the Trainer would do
        # both later): zero.Init reads the world size from it to partition over every rank.
        import deepspeed

        _ = args.device
        deepspeed.init_distributed()
    from workbench.train.strategy import resolved_in_backward, run_precision

    model = getattr(stage, "load_model", load_model)(spec, source, run_precision(spec, rd))
    _startup("model")
    loaded_at = _storage(model)  # to tell whether the Trainer's set-up copies the weights
    fast_line = applied_line(args, model)  # what the Trainer really got, for logs and status
    print(fast_line, flush=True)
    if rank == 0:
        rd.write_status(fast_paths=fast_line)
        if stage and spec.eval.tasks:  # the plan said so too (workbench.plan.scoring_time)
            print("eval: tasks are not scored in this run (its trainer reports validation "
                  "metrics); score it afterwards with job.evaluate()", flush=True)
    status = rd.status()
    billing = Billing(spec, status)  # the supervisor's baseline: the same bill as its own
    uploader = None
    if rank == 0 and spec.checkpoint.storage:
        uploader = Uploader(rd, storage_prefix(spec.checkpoint.storage, rd.path.name),
                            keep=spec.checkpoint.keep)
        uploader.catch_up(newest_verified(rd))  # what a crashed attempt had not uploaded yet
    snapshots = SnapshotCallback(spec, billing, status.get("step_s"))
    trainer = snapshotting_trainer_class(stage.trainer_base(spec) if stage else None)(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=eval_rows if len(eval_rows) else None,
        **(stage.trainer_kwargs(spec, tokenizer, source, rd) if stage
           else {"data_collator": Collator(tokenizer.pad_token_id)}),
        # In-run scoring (eval:) answers validation prompts: SFT rows. Preference stages report
        # TRL's own validation metrics (rewards/accuracies); job.evaluate() scores them after.
        callbacks=[RunDirCallback(rd, world), snapshots,
                   *([] if stage else [EvalCallback(rd, spec, tokenizer, billing, snapshots)]),
                   *hold_callbacks()],
        run_dir=rd, keep=spec.checkpoint.keep, uploader=uploader, billing=billing,
        optimizer_in_backward=resolved_in_backward(spec, rd),
    )
    _startup("trainer")
    resume_from = agreed_resume_point(rd)  # verified by rank 0 alone, the same on every rank
    if resume_from is not None:
        print(f"resuming from {resume_from.name}", flush=True)
    elif (status.get("billed_before_s") or 0) > 0:  # a resume, with nothing to resume from
        note = ("resumed without a snapshot: training started again at step 0 (set "
                "checkpoint.every_steps or every_minutes to resume mid-run next time)")
        print(note, flush=True)
        if rank == 0:
            rd.write_status(note=note)
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except BudgetSpentAtStart as exc:  # every rank raised it: nothing trained, nothing to save
        print(f"budget: {exc}; stopping before the first step", flush=True)
        if rank == 0:
            rd.write_status(stop_reason="budget")
        if uploader is not None:
            uploader.close()
        _shutdown_distributed()
        return 0
    trainer.writer.wait()  # the last snapshot is on disk (and committed) before we go on
    print("weights: trained where they were loaded" if _storage(trainer.model) == loaded_at
          else f"weights: moved to {args.device} by the Trainer's set-up (a copy)", flush=True)
    if snapshots.budget_stopped:
        if rank == 0:  # the supervisor writes the bill and the note when the attempt ends
            rd.write_status(stop_reason="budget")
    elif len(eval_rows) and not _evaluated_at(trainer.state.log_history,
                                              trainer.state.global_step):
        trainer.evaluate()
    out = save_artefacts(trainer, tokenizer, spec, rd, source)
    print(f"saved {out}", flush=True)
    if uploader is not None:
        uploader.close()
    # After everything this rank held memory for (training, the in-run evaluation, saving).
    from workbench.train.callbacks import record_peak_memory

    record_peak_memory(rd, rank)
    _shutdown_distributed()
    _exit_now(0)


def _storage(model: Any) -> int:
    """Where the model's first weight lives: the same address after training means neither the
    Trainer nor accelerate moved (copied) the weights (optimizers update them in place)."""
    return int(next(model.parameters()).data_ptr())


def _exit_now(code: int) -> NoReturn:
    """End the rank now that everything it writes is closed and on disk. The interpreter's own
    teardown of torch/transformers (seconds: it frees every module and object; figures in
    docs/benchmarks.md) would only delay torchrun, the supervisor's bill and the
    user's ``wait``. What a normal exit would still do for data is done here: other threads are
    joined and the exit handlers (logging's flush, wandb's finish, temporary folders) run, as the
    interpreter does before its teardown."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _evaluated_at(log_history: list[dict[str, Any]], step: int) -> bool:
    # Every rank keeps the same history, so all ranks agree to skip (evaluate is collective).
    return any("eval_loss" in h and h.get("step") == step for h in log_history)


def _shutdown_distributed() -> None:
    # Leaving a gloo group alive at interpreter exit aborts the process ("terminate called
    # without an active exception"), which would turn a finished run into a failed one.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
