"""The Trainer's arguments for a run: the spec's training knobs, the parallel strategy (DDP or a
DeepSpeed ZeRO config), mixed precision, the fast paths and where metrics are reported; the
process environment is set to match (one process trains without a process group, a CPU rank
on the device ``cpu``).
"""

from __future__ import annotations

import os
from typing import Any

from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec
from workbench.spec.sections import EVALS_PER_RUN
from workbench.train.fastpath import for_run

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
        resolved_in_backward,
        resolved_optimizer,
        resolved_parallel,
        run_precision,
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
    precision = run_precision(spec, rd)
    in_backward = resolved_in_backward(spec, rd)
    if in_backward:
        print("optimizer: stepped in backward, each parameter as its gradient arrives (no "
              "gradient clipping)", flush=True)
    from workbench.spec.models import resolve_model

    fast = for_run(spec, resolve_model(spec.model.id), precision.load_dtype,
                   zero_stage=int(parallel.strategy[-1]) if ds_config else 0,
                   offload_optimizer=parallel.offload_optimizer and ds_config is not None,
                   optimizer=resolved_optimizer(spec, rd))
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
        # No global norm exists before a step in backward: no clipping there (workbench.spec.stepping).
        max_grad_norm=t.max_grad_norm if t.max_grad_norm is not None else (
            0.0 if in_backward else 1.0),
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
