"""Every knob of a RunSpec in one line each, and the spec as YAML with those lines as comments
(``workbench spec -o spec.yaml``: a starting point that explains itself).

``KNOBS`` maps each field's dotted path (``[]`` for an item of a list) to what it does, and each
list of items (sources, rewards, tasks) to what it holds; the suite checks that every field of
:class:`~workbench.spec.RunSpec` has one, so a new knob comes with its line.
"""

from __future__ import annotations

from typing import Any

import yaml

KNOBS: dict[str, str] = {
    "name": "the run's name (letters, digits, - _ .); runs are found by it or by their id",
    "model.id": "built-in name, a folder saved with save_pretrained, or a hub id ORG/NAME",
    "model.revision": "hub revision (branch, tag or commit)",
    "model.dtype": "auto: bf16 on a GPU that has it, fp32 on CPU",
    "model.quantization": "4bit or 8bit base weights: method.kind qlora only",
    "model.trust_remote_code": "run the model folder's own Python (only for models you trust)",
    "data.sources": "where the examples come from; several sources are read one after another",
    "data.sources[].path": "jsonl / json / csv / parquet file, save_to_disk folder, or hub id",
    "data.sources[].format": "auto, alpaca, sharegpt, messages, text; pairs, unpaired, prompts "
                             "for dpo/orpo, kto, grpo",
    "data.sources[].split": "which split of a hub dataset or a DatasetDict on disk",
    "data.sources[].max_rows": "read at most this many rows (quick trials)",
    "data.sources[].columns": "your columns by part, e.g. {prompt: question, response: answer}",
    "data.validation_fraction": "held out for evaluation, by content hash (appending keeps it)",
    "data.max_length": "tokens per example; longer ones are truncated",
    "data.truncation": "keep_response: cut the prompt first; right: cut the end",
    "data.max_dropped_fraction": "launch refuses when more examples would have nothing to train",
    "data.packing": "whole examples share max_length rows (no padding, attention per example)",
    "data.eval_samples": "validation examples evaluated each time; 0 or null: all",
    "data.image_min_pixels": "vision models: each image resized to at least this many pixels; "
                             "null: the processor's own",
    "data.image_max_pixels": "vision models: each image resized to at most this many pixels "
                             "(Qwen2-VL: a token per 28x28); null: the processor's own",
    "data.clean.enabled": "run the cleaning pipeline on the text first (docs/data.md)",
    "data.clean.steps": "null: the default pipeline, in its default order",
    "data.clean.options": "per-step parameters, e.g. {near_dedup: {threshold: 0.8}}",
    "method.kind": "lora, qlora (LoRA on a 4-bit base) or full fine-tuning",
    "method.stage": "sft, or dpo / orpo / kto / grpo after it (docs/preference.md)",
    "method.lora_r": "LoRA rank: more capacity and more memory",
    "method.lora_alpha": "LoRA scale is alpha / r",
    "method.lora_dropout": "dropout on the LoRA input",
    "method.target_modules": "all-linear, or a list of module names to adapt",
    "method.beta": "dpo/orpo/kto: strength of the preference term; null: TRL's default",
    "method.loss_type": "TRL's loss variant (dpo: sigmoid, ipo, hinge...); null: its default",
    "method.reference": "dpo/kto reference: auto (LoRA: the base, adapter off) or explicit (a copy)",
    "method.num_generations": "grpo: completions sampled per prompt (the group)",
    "method.max_completion_length": "grpo: tokens generated per completion",
    "method.temperature": "grpo: sampling temperature of the completions",
    "method.rewards": "grpo: the reward functions, summed by weight",
    "method.rewards[].fn": "built-in (exact_match, contains, regex, length) or 'module:function'",
    "method.rewards[].weight": "its share of the summed reward",
    "method.rewards[].column": "exact_match/contains: the data column holding the reference",
    "method.rewards[].pattern": "regex: 1 when the completion matches, else 0",
    "method.rewards[].target_chars": "length: 1 at this many characters, less away from it",
    "train.epochs": "passes over the training split",
    "train.max_steps": "stop after this many optimizer steps (overrides epochs)",
    "train.batch_size": "examples per process (per GPU) per step",
    "train.grad_accum": "steps whose gradients add up before one optimizer update",
    "train.lr": "peak learning rate",
    "train.scheduler": "learning-rate schedule: cosine, linear, constant, constant_with_warmup",
    "train.warmup_ratio": "share of the steps the learning rate ramps up over",
    "train.weight_decay": "AdamW weight decay",
    "train.seed": "seed of the data order, the split and the initial adapter weights",
    "train.gradient_checkpointing": "~30% slower for much less activation memory",
    "train.log_every": "steps between metric lines",
    "train.eval_every": "steps between evaluations; null: about 10 per run, 0: at the end",
    "train.fast.liger": "Liger's fused kernels (CUDA): auto, on or off",
    "train.fast.attention": "auto (flash-attn where installed), default, sdpa, flash_attention_2, eager",
    "train.fast.fused_adamw": "torch's fused AdamW kernel on a GPU",
    "train.fast.tf32": "TF32 matmuls for fp32 work on Ampere and newer cards",
    "train.optimizer": "auto, adamw, adamw_8bit or paged_adamw_8bit (bitsandbytes, CUDA)",
    "train.optimizer_in_backward": "auto, true or false: step each parameter as its gradient "
                                   "arrives and free it (full fine-tuning, one process)",
    "train.master_weights": "auto, fp32 or none (pure bf16 weights: less memory, small updates "
                            "lost); auto: none only with optimizer_in_backward on a bf16 GPU",
    "train.max_grad_norm": "clip gradients to this global norm, 0: never; null: 1.0 (none with "
                           "optimizer_in_backward)",
    "resources.gpus_per_node": "GPUs each node gives the run; 0: train on CPU",
    "resources.processes_per_node": "null: one per GPU, or 2 on CPU",
    "resources.nodes": "machines the run spans (SSH hosts or Slurm nodes)",
    "resources.gpu_type": "for planning and pricing, e.g. A100-80G; null: detected",
    "target": "local, ssh:NAME or slurm:NAME (WORKBENCH_HOME/targets.yaml)",
    "parallel.strategy": "auto, ddp, or zero1 / zero2 / zero3 (DeepSpeed)",
    "parallel.offload_optimizer": "ZeRO: optimizer state in CPU memory",
    "parallel.offload_params": "ZeRO-3: parameters in CPU memory",
    "checkpoint.every_steps": "snapshot every N steps (a run resumes from the newest)",
    "checkpoint.every_minutes": "snapshot every N minutes",
    "checkpoint.keep": "snapshots kept (the newest ones)",
    "checkpoint.storage": "also copy snapshots to a folder or an s3:// URL",
    "budget.currency": "currency of the prices and the limit",
    "budget.price_per_gpu_hour": "null: from the GPU table",
    "budget.price_per_cpu_core_hour": "price of a CPU core-hour (CPU runs)",
    "budget.limit": "stop cleanly before the bill passes this",
    "tracking.tensorboard": "write TensorBoard event files in the run directory",
    "tracking.wandb": "disabled, offline (writes RUN_DIR/wandb/; upload later with `wandb sync "
                      "RUN_DIR/wandb/offline-run-*`) or online (WANDB_API_KEY or `wandb login`); "
                      "pip install 'workbench[wandb]'",
    "serve.merge": "serve merged weights instead of the base plus the LoRA adapter",
    "serve.max_model_len": "longest prompt + answer the endpoint accepts, in tokens",
    "serve.python": "interpreter with vLLM; null: WORKBENCH_SERVE_PYTHON, .venv-serve, this one",
    "eval.before": "score the base model once, before the first step",
    "eval.every_steps": "score the weights every N steps (beside training)",
    "eval.after": "score the trained weights at the end",
    "eval.tasks": "what to score; none: eval loss on the validation split only",
    "eval.tasks[].kind": "heldout, perplexity, lm_eval or judge (docs/evaluate.md)",
    "eval.tasks[].file": "questions and answers to score on; null: the validation split",
    "eval.tasks[].tasks": "lm_eval: task names and/or task YAML paths",
    "eval.tasks[].max_samples": "examples scored (null: all of them)",
    "eval.tasks[].max_new_tokens": "generated tokens per answer (greedy)",
    "eval.tasks[].judge": "judge: a deployed endpoint's name or an OpenAI-compatible URL (.../v1)",
    "eval.tasks[].judge_model": "judge: its model name; null: the endpoint's default",
    "eval.tasks[].api_key_env": "judge: the environment variable holding its API key",
    "eval.tasks[].rubric": "judge: the question the judge answers about two answers",
    "eval.tasks[].chat_template": "lm_eval: prompts through the model's chat template",
}


def _line(key: str, value: Any, comment: str | None, indent: str) -> str:
    text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
    text = text[1:-1] if text.startswith("{") else text  # {key: value} -> key: value
    return f"{indent}{text}" + (f"  # {comment}" if comment else "")


def _mapping(data: dict[str, Any], prefix: str, indent: str) -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            comment = f"  # {KNOBS[path]}" if path in KNOBS else ""
            out.append(f"{indent}{key}:{comment}")  # a list of items (sources, rewards, tasks)
            for item in value:
                lines = _mapping(item, f"{path}[].", indent + "    ")
                lines[0] = f"{indent}  - {lines[0].lstrip()}"
                out += lines
        elif path in KNOBS:  # a knob: its value on one line, with its comment
            out.append(_line(key, value, KNOBS[path], indent))
        elif isinstance(value, dict):  # a section
            out.append(f"{indent}{key}:")
            out += _mapping(value, f"{path}.", indent + "  ")
        else:
            out.append(_line(key, value, None, indent))
    return out


def commented_yaml(spec: Any) -> str:
    """``spec`` as YAML with each knob's line as a comment; it loads back to the same spec."""
    return "\n".join(_mapping(spec.model_dump(mode="json"), "", "")) + "\n"
