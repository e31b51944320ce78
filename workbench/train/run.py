"""One training process: read RUN_DIR, build model + tokenizer + data, run the Trainer, save artefacts.

Every rank runs this (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE). It is deliberately one
readable function per stage, in the order a reader expects: logs, spec, tokenizer, model, data,
trainer, save. Terminal states (succeeded / failed / cancelled) are written by the supervisor that
started the ranks, because only it sees every rank's exit.
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
from workbench.spec import EVALS_PER_RUN, RunSpec
from workbench.spec.precision import Precision, local_device_kind, resolve_precision
from workbench.train.fastpath import FastPaths, applied_line, for_run


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


def load_model(spec: RunSpec, source: str, precision: Precision | None = None,
               fast: FastPaths | None = None) -> Any:
    """The model (peft-wrapped for LoRA/QLoRA) in the dtypes :mod:`workbench.spec.precision` chose
    for this device, with the attention kernel :mod:`workbench.train.fastpath` chose
    (``precision`` / ``fast`` override the choices, e.g. to check a GPU's choice on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = precision or resolve_precision(spec.model.dtype, spec.method.kind, local_device_kind())
    print(f"precision: load {p.load_dtype}, amp {p.amp}: {p.reason}", flush=True)
    fast = fast or for_run(spec, source, p.load_dtype)
    kwargs: dict[str, Any] = {"revision": spec.model.revision,
                              "trust_remote_code": spec.model.trust_remote_code,
                              **fast.model_kwargs()}
    dtype = getattr(torch, p.load_dtype)
    kwargs["dtype"] = dtype
    if spec.model.quantization != "none":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=spec.model.quantization == "4bit",
            load_in_8bit=spec.model.quantization == "8bit",
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, p.compute_dtype),
        )
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    model: Any = AutoModelForCausalLM.from_pretrained(source, **kwargs)  # or its peft wrapper
    _log_partitioning(model)
    if spec.method.kind in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if spec.method.kind == "qlora":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=spec.train.gradient_checkpointing)
        lora = LoraConfig(
            r=spec.method.lora_r,
            lora_alpha=spec.method.lora_alpha,
            lora_dropout=spec.method.lora_dropout,
            target_modules=spec.method.target_modules,
            task_type="CAUSAL_LM",
        )
        # peft keeps the adapters fp32 over a 16-bit base (autocast_adapter_dtype), so they and
        # their Adam state never lose small updates.
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    return model


def _log_partitioning(model: Any) -> None:
    """Under ZeRO-3, say how much of the model this rank holds right after loading."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    params = list(model.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    print(f"zero3: loaded partitioned: this rank holds {local} of {total} parameter elements",
          flush=True)


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


_DIST_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def training_arguments(spec: RunSpec, rd: RunDir, has_eval: bool, args_class: type | None = None,
                       **extra: Any) -> Any:
    """The Trainer's arguments (``args_class``: a TRL config, with its ``extra`` knobs)."""
    import torch
    from transformers import TrainingArguments

    from workbench.train.strategy import (
        clear_stale_extension_locks,
        deepspeed_config,
        install_cpu_deepspeed_shim,
        resolved_parallel,
    )

    cuda = torch.cuda.is_available()
    parallel = resolved_parallel(spec, rd)
    ds_config = deepspeed_config(parallel, cuda)
    if ds_config is not None:
        clear_stale_extension_locks()
        install_cpu_deepspeed_shim()
    single = ds_config is None and os.environ.get("WORLD_SIZE", "1") == "1"
    if single:
        # One process without DeepSpeed: train as a plain script does. With LOCAL_RANK set the
        # Trainer would join a process group of one and wrap the model in DDP, which costs
        # start-up and a gloo all-reduce per step for nothing.
        for key in _DIST_ENV:
            os.environ.pop(key, None)
    if not cuda and ds_config is None:
        # accelerate gives a DDP run's CPU rank the device cpu:N, and .to("cpu:0") copies a
        # tensor on "cpu": the Trainer's move and accelerate's prepare would each copy every
        # weight.
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    print(f"strategy: {spec.method.kind} + {parallel.strategy}"
          f"{' (offload optimizer)' if parallel.offload_optimizer else ''}"
          f"{' (offload params)' if parallel.offload_params else ''}", flush=True)
    t = spec.train
    report_to = []
    if spec.tracking.tensorboard:
        report_to.append("tensorboard")
        # Always this run's folder: an inherited value (a user's shell, or a process that built
        # another run's arguments) would send the run's TensorBoard logs elsewhere.
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(rd.tb_dir)
    if spec.tracking.wandb != "disabled":
        report_to.append("wandb")
        os.environ.setdefault("WANDB_MODE", spec.tracking.wandb)
        os.environ.setdefault("WANDB_DIR", str(rd.path))
        os.environ.setdefault("WANDB_PROJECT", "workbench")
    precision = resolve_precision(spec.model.dtype, spec.method.kind, local_device_kind())
    from workbench.spec.models import resolve_model

    fast = for_run(spec, resolve_model(spec.model.id), precision.load_dtype,
                   zero_stage=int(parallel.strategy[-1]) if ds_config else 0,
                   offload_optimizer=parallel.offload_optimizer and ds_config is not None)
    for note in fast.notes:
        print(f"fast path: {note}", flush=True)
    return (args_class or TrainingArguments)(
        output_dir=str(rd.path / "checkpoints"),  # the Trainer's checkpoint-N, see SnapshotCallback
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr,
        lr_scheduler_type=t.scheduler,
        warmup_steps=t.warmup_ratio,  # a float in [0, 1) is a ratio of total steps
        weight_decay=t.weight_decay,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        seed=t.seed,
        activation_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        logging_steps=t.log_every,
        logging_first_step=True,
        eval_strategy="steps" if (has_eval and t.eval_every != 0) else "no",
        eval_steps=t.eval_every or 1 / EVALS_PER_RUN,  # a float < 1 is a ratio of total steps
        save_strategy="no",
        report_to=report_to,
        use_cpu=not cuda,
        ddp_backend=None if cuda or single else "gloo",
        ddp_find_unused_parameters=False,
        bf16=precision.amp == "bf16",
        fp16=precision.amp == "fp16",
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        deepspeed=ds_config,
        **fast.training_kwargs(),
        **extra,
    )


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
                     billing: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rd, self.keep, self.uploader, self.billing = run_dir, keep, uploader, billing
            self.writer = AsyncWriter(self.args.process_index)

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
    from workbench.spec.models import resolve_model
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
    tokenizer = load_tokenizer(spec, source)
    _startup("tokenizer")
    from transformers import set_seed

    set_seed(spec.train.seed)  # before the LoRA init, so the same spec trains the same way
    stage: Any = None  # the module workbench.train.preference for a non-SFT stage
    if spec.method.stage != "sft":  # dpo/orpo/kto/grpo: TRL's trainers, the same path otherwise
        from workbench.train import preference as stage
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
    model = load_model(spec, source)
    _startup("model")
    loaded_at = _storage(model)  # to tell whether the Trainer's set-up copies the weights
    fast_line = applied_line(args, model)  # what the Trainer really got, for logs and status
    print(fast_line, flush=True)
    if rank == 0:
        rd.write_status(fast_paths=fast_line)
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
    teardown of torch/transformers (half a million objects: seconds of module and object
    teardown, docs/benchmarks.md) would only delay torchrun, the supervisor's bill and the
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
