"""The sections of a RunSpec: one pydantic model per part of a run (model, data, method, train,
resources, parallel, checkpoint, budget, tracking, serve, eval), each with its defaults and the
checks that need only that section.

:class:`~workbench.spec.RunSpec` puts them together and adds the checks that span sections; a
section on its own validates the same way, e.g. ``DataSource(path="train.jsonl")``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATASET = "builtin:teaching"
EVALS_PER_RUN = 10  # validation points of a run that leaves train.eval_every unset


class Section(BaseModel):
    # extra="forbid" turns a typo in a field name into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Section):
    id: str = Field(BUILTIN_MODEL, description="built-in name, local folder, or hub id")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    quantization: Literal["none", "4bit", "8bit"] = "none"  # 4bit is what QLoRA trains on
    trust_remote_code: bool = False


# The parts a dataset column can play (DataSource.columns), each with what it means.
COLUMN_ROLES = ("prompt", "query", "response", "system", "messages", "text", "chosen",
                "rejected", "completion", "label")


class DataSource(Section):
    path: str = Field(BUILTIN_DATASET, description="jsonl/csv/parquet file, datasets folder, hub id")
    # pairs, unpaired, prompts: preference data for method.stage dpo/orpo, kto, grpo
    format: Literal["auto", "alpaca", "sharegpt", "messages", "text", "pairs", "unpaired",
                    "prompts"] = "auto"
    split: str = "train"  # which split of a hub dataset or a DatasetDict on disk
    max_rows: int | None = Field(None, gt=0)  # read at most this many rows (quick trials)
    # Which of the file's columns plays which part, e.g. {prompt: question, response: answer}:
    # prompt, query (extra input), response, system, messages, text, chosen, rejected,
    # completion, label. Columns not named keep their names.
    columns: dict[str, str] | None = None

    @field_validator("columns")
    @classmethod
    def _columns_ok(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        unknown = sorted(set(v) - set(COLUMN_ROLES))
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}; a column can be the "
                             f"{', '.join(COLUMN_ROLES)}")
        if len(set(v.values())) < len(v):
            raise ValueError("one column is named for two parts; name each column once")
        return v


class CleanSpec(Section):
    """Cleaning applied to the text of each example before formatting (see workbench.data)."""

    enabled: bool = False
    steps: list[str] | None = None  # None: the default pipeline, in its default order
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per-step parameters


class DataSpec(Section):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource()], min_length=1)
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0)  # held out by content hash
    max_length: int = Field(256, ge=16)  # tokens per example; longer ones are truncated
    # keep_response: a long example loses the start of its prompt first (the response keeps at
    #   least half of max_length); right: cut the end, which may cut the whole response away.
    truncation: Literal["keep_response", "right"] = "keep_response"
    max_dropped_fraction: float = Field(0.01, ge=0.0, le=1.0)  # launch refuses above this share
    packing: bool = False  # whole examples share max_length rows, attention kept per example
    eval_samples: int | None = Field(256, ge=0)  # validation examples evaluated; 0/None: all
    clean: CleanSpec = Field(default_factory=CleanSpec)
    # Vision-language models that resize each image to a pixel budget (Qwen2-VL and its kin):
    # the budget's bounds (None: the processor's own). An image's tokens, so its memory and
    # time, follow its pixels: Qwen2-VL makes one token of each 28x28 pixels.
    image_min_pixels: int | None = Field(None, ge=1)
    image_max_pixels: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _image_bounds_in_order(self) -> DataSpec:
        low, high = self.image_min_pixels, self.image_max_pixels
        if low is not None and high is not None and low > high:
            raise ValueError(f"image_min_pixels ({low}) is above image_max_pixels ({high}); "
                             "lower the first or raise the second")
        return self


Stage = Literal["sft", "dpo", "orpo", "kto", "grpo"]
PREFERENCE_STAGES = ("dpo", "orpo", "kto", "grpo")
BUILTIN_REWARDS = ("exact_match", "contains", "regex", "length")
_REWARD_FN_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class RewardSpec(Section):
    """One GRPO reward (workbench.train.rewards); the rewards of a completion are summed."""

    fn: str  # built-in (exact_match, contains, regex, length) or a user's 'module:function'
    weight: float = 1.0  # its share of the summed reward
    column: str = "answer"  # exact_match/contains: the data column holding the reference
    pattern: str | None = None  # regex: 1 when the completion matches (re.search), else 0
    target_chars: int | None = Field(None, ge=1)  # length: 1 at this many characters, less away

    @field_validator("fn")
    @classmethod
    def _fn_ok(cls, v: str) -> str:
        if v not in BUILTIN_REWARDS and not _REWARD_FN_RE.fullmatch(v):
            raise ValueError(f"use a built-in reward ({', '.join(BUILTIN_REWARDS)}) or "
                             "'module:function' for your own")
        return v

    @model_validator(mode="after")
    def _options_ok(self) -> RewardSpec:
        if self.fn == "regex" and not self.pattern:
            raise ValueError("the regex reward needs a pattern, e.g. pattern: '^[a-z]+$'")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regex: {exc}") from None
        if self.fn == "length" and self.target_chars is None:
            raise ValueError("the length reward needs target_chars, e.g. target_chars: 40")
        return self


class MethodSpec(Section):
    kind: Literal["lora", "qlora", "full"] = "lora"
    # What is learnt from what: sft (demonstrations), dpo/orpo (preference pairs), kto (liked or
    # disliked completions), grpo (rewards of sampled completions). See docs/preference.md.
    stage: Stage = "sft"
    lora_r: int = Field(16, ge=1, le=1024)  # higher: more capacity and more memory
    lora_alpha: int = Field(32, ge=1)  # scale = alpha / r
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # dpo/kto: how far from the reference the policy may move; orpo: the odds-ratio weight; grpo:
    # the KL penalty (0 drops the KL term and its reference pass). None: 0.1, or 0.04 for grpo.
    beta: float | None = Field(None, ge=0)
    loss_type: str | None = None  # TRL's loss variant (dpo: sigmoid, ipo, hinge...); None: default
    # dpo/kto (and grpo with beta > 0) compare against a frozen reference. auto: LoRA uses the base
    # with the adapter switched off (no second copy); full weights load a frozen copy. explicit:
    # always a separate frozen copy. orpo needs no reference at all.
    reference: Literal["auto", "explicit"] = "auto"
    num_generations: int = Field(4, ge=2)  # grpo: completions sampled per prompt (the group)
    max_completion_length: int = Field(32, ge=1)  # grpo: tokens generated per completion
    temperature: float = Field(1.0, gt=0)  # grpo: sampling temperature of the completions
    rewards: list[RewardSpec] = Field(default_factory=list)  # grpo: summed per completion


Switch = Literal["auto", "on", "off"]


class FastSpec(Section):
    """The training fast paths (workbench.train.fastpath decides ``auto``; plan and status say
    what was chosen). ``train.fast: off`` turns every switch off, ``auto`` leaves them to it."""

    liger: Switch = "auto"  # Liger's fused RMSNorm/SwiGLU/RoPE/loss kernels (CUDA, liger-kernel)
    # auto: flash_attention_2 where flash-attn is installed and the weights are 16-bit, else
    # transformers' default (sdpa where the model has it); default: always transformers' choice.
    attention: Literal["auto", "default", "sdpa", "flash_attention_2", "eager"] = "auto"
    fused_adamw: Switch = "auto"  # torch's fused AdamW kernel (adamw_torch_fused)
    tf32: Switch = "auto"  # TF32 matmuls for fp32 work on Ampere and newer cards

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if v == "off":
            return {"liger": "off", "attention": "default", "fused_adamw": "off", "tf32": "off"}
        if v == "auto":
            return {}
        return v


class TrainSpec(Section):
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0)  # overrides epochs when set
    batch_size: int = Field(8, ge=1)  # per process (per GPU)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0, lt=1)
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 42
    gradient_checkpointing: bool = False  # trade ~30% speed for much less activation memory
    log_every: int = Field(1, ge=1)  # steps between metrics lines
    # Steps between validation losses. None: about EVALS_PER_RUN per run (a curve to read, for
    # the forward passes of ~EVALS_PER_RUN x validation_fraction of an epoch); 0: only at the end.
    eval_every: int | None = Field(None, ge=0)
    fast: FastSpec = Field(default_factory=FastSpec)  # auto | off | per switch (FastSpec)
    # AdamW, or bitsandbytes' 8-bit AdamW (paged: its states move to host RAM when the card is
    # short). auto: AdamW, or the paged 8-bit one where only that fits (parallel.strategy: auto).
    optimizer: Literal["auto", "adamw", "adamw_8bit", "paged_adamw_8bit"] = "auto"
    # Step each parameter's optimizer from its gradient hook during backward and free the
    # gradient at once, so no full set of gradients is held (full fine-tuning on one process,
    # no accumulation or clipping: workbench.spec.stepping). auto: where only that fits
    # (parallel.strategy: auto, on a bf16 GPU).
    optimizer_in_backward: Literal["auto"] | bool = "auto"
    # What full fine-tuning keeps its weights in: fp32 master weights, or none (pure bf16: half
    # the memory, but updates below bf16's resolution are lost). auto: fp32, except with the
    # optimizer stepped in backward on a bf16 GPU (workbench.spec.precision).
    master_weights: Literal["auto", "fp32", "none"] = "auto"
    # Clip the gradients' global norm to this (0: no clipping). None: 1.0, or no clipping with
    # the optimizer stepped in backward (each step runs before the global norm is known).
    max_grad_norm: float | None = Field(None, ge=0)


class ResourceSpec(Section):
    gpus_per_node: int = Field(0, ge=0)  # 0: train on CPU
    processes_per_node: int | None = Field(None, ge=1)  # None: one per GPU, or 2 on CPU
    nodes: int = Field(1, ge=1)
    gpu_type: str | None = None  # for planning and pricing, e.g. "A100-80G"

    @property
    def procs_per_node(self) -> int:
        if self.processes_per_node is not None:
            return self.processes_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 2

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.nodes


class ParallelSpec(Section):
    strategy: Literal["auto", "ddp", "zero1", "zero2", "zero3"] = "auto"
    offload_optimizer: bool = False
    offload_params: bool = False


class CheckpointSpec(Section):
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    keep: int = Field(2, ge=1)
    storage: str | None = None  # folder or s3:// URL


class BudgetSpec(Section):
    currency: str = "CNY"
    price_per_gpu_hour: float | None = Field(None, ge=0)  # None: from the price table
    price_per_cpu_core_hour: float = Field(0.0, ge=0)
    limit: float | None = Field(None, gt=0)  # stop cleanly before passing it


class TrackingSpec(Section):
    tensorboard: bool = True
    wandb: Literal["disabled", "offline", "online"] = "disabled"


class ServeSpec(Section):
    merge: bool = False  # serve merged weights instead of base + LoRA adapter
    max_model_len: int = Field(256, ge=16)
    python: str | None = None  # interpreter with vLLM; None: WORKBENCH_SERVE_PYTHON, .venv-serve, this one


EVAL_KINDS = ("heldout", "perplexity", "lm_eval", "judge")


class EvalTask(Section):
    """One scoring task of ``eval.tasks``. In YAML a bare kind is enough: ``tasks: [heldout]``."""

    kind: Literal["heldout", "perplexity", "lm_eval", "judge"]
    # heldout/judge: prompts + references (messages, alpaca, ...; None: the run's validation
    # split); perplexity: any text or chat file (None: the validation split).
    file: str | None = None
    tasks: list[str] = Field(default_factory=list)  # lm_eval: task names and/or task YAML paths
    max_samples: int | None = Field(64, ge=1)  # examples scored (None: all of them)
    max_new_tokens: int = Field(32, ge=1)  # generated tokens per answer (greedy)
    # judge: a Workbench endpoint name or an OpenAI-compatible base URL (.../v1), the judge's
    # model name (None: the endpoint's default / the server's first), the environment variable
    # that holds its API key, and what a good answer is.
    judge: str | None = None
    judge_model: str | None = None
    api_key_env: str | None = None
    rubric: str = "Which answer is more correct, helpful and concise for the question?"
    chat_template: bool = True  # lm_eval: prompts through the model's chat template (as trained)

    @model_validator(mode="after")
    def _needs(self) -> EvalTask:
        if self.kind == "lm_eval" and not self.tasks:
            raise ValueError("an lm_eval task needs tasks: [NAME or /path/task.yaml, ...]")
        if self.kind == "judge" and not self.judge:
            raise ValueError("a judge task needs judge: ENDPOINT_NAME or an http(s):// base URL")
        return self


class EvalSpec(Section):
    """What to score and when (see docs/evaluate.md). The default scores the validation split
    once after training (``heldout``, 64 examples: seconds for a small model); ``before`` adds
    the base model's scores, ``every_steps`` the curve in between."""

    before: bool = False  # score the base model once, before the first step
    every_steps: int | None = Field(None, ge=1)  # score the weights every N steps
    after: bool = True  # score the trained weights at the end
    tasks: list[EvalTask] = Field(default_factory=lambda: [EvalTask(kind="heldout")])

    @field_validator("tasks", mode="before")
    @classmethod
    def _bare_kinds(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"kind": t} if isinstance(t, str) else t for t in v]
        return v

