"""RunSpec: the one validated, serialisable description of a fine-tuning run.

Every front end (widgets, magics, CLI, lab panel) builds a :class:`RunSpec` and hands it to the
same library calls. A spec round-trips through YAML (``RunSpec.from_yaml`` / ``to_yaml``) and every
validation problem is reported as a :class:`~workbench.errors.SpecError` naming the field path and
what to do, e.g. ``train.lr: must be greater than 0``.

    >>> spec = RunSpec(name="demo", train={"max_steps": 10})
    >>> RunSpec.from_yaml(spec.to_yaml()) == spec
    True
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workbench.errors import SpecError

BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATASET = "builtin:teaching"
EVALS_PER_RUN = 10  # validation points of a run that leaves train.eval_every unset


class _Section(BaseModel):
    # extra="forbid" turns a typo in a field name into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    id: str = Field(BUILTIN_MODEL, description="built-in name, local folder, or hub id")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    quantization: Literal["none", "4bit", "8bit"] = "none"  # 4bit is what QLoRA trains on
    trust_remote_code: bool = False


# The parts a dataset column can play (DataSource.columns), each with what it means.
COLUMN_ROLES = ("prompt", "query", "response", "system", "messages", "text", "chosen",
                "rejected", "completion", "label")


class DataSource(_Section):
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


class CleanSpec(_Section):
    """Cleaning applied to the text of each example before formatting (see workbench.data)."""

    enabled: bool = False
    steps: list[str] | None = None  # None: the default pipeline, in its default order
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per-step parameters


class DataSpec(_Section):
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


Stage = Literal["sft", "dpo", "orpo", "kto", "grpo"]
PREFERENCE_STAGES = ("dpo", "orpo", "kto", "grpo")
BUILTIN_REWARDS = ("exact_match", "contains", "regex", "length")
_REWARD_FN_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class RewardSpec(_Section):
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


class MethodSpec(_Section):
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


class FastSpec(_Section):
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


class TrainSpec(_Section):
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


class ResourceSpec(_Section):
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


class ParallelSpec(_Section):
    strategy: Literal["auto", "ddp", "zero1", "zero2", "zero3"] = "auto"
    offload_optimizer: bool = False
    offload_params: bool = False


class CheckpointSpec(_Section):
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    keep: int = Field(2, ge=1)
    storage: str | None = None  # folder or s3:// URL


class BudgetSpec(_Section):
    currency: str = "CNY"
    price_per_gpu_hour: float | None = Field(None, ge=0)  # None: from the price table
    price_per_cpu_core_hour: float = Field(0.0, ge=0)
    limit: float | None = Field(None, gt=0)  # stop cleanly before passing it


class TrackingSpec(_Section):
    tensorboard: bool = True
    wandb: Literal["disabled", "offline", "online"] = "disabled"


class ServeSpec(_Section):
    merge: bool = False  # serve merged weights instead of base + LoRA adapter
    max_model_len: int = Field(256, ge=16)
    python: str | None = None  # interpreter with vLLM; None: WORKBENCH_SERVE_PYTHON, .venv-serve, this one


EVAL_KINDS = ("heldout", "perplexity", "lm_eval", "judge")


class EvalTask(_Section):
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


class EvalSpec(_Section):
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


# Used with fullmatch: "$" alone accepts a trailing newline, which would break an #SBATCH line.
_TARGET_RE = re.compile(r"local|(ssh|slurm):[A-Za-z0-9_.-]+")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunSpec(_Section):
    """A whole run. Every section has defaults: ``RunSpec()`` is the built-in quickstart."""

    name: str = "quickstart"
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    method: MethodSpec = Field(default_factory=MethodSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    target: str = "local"  # local, ssh:NAME or slurm:NAME
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    serve: ServeSpec = Field(default_factory=ServeSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)

    def __init__(self, **data: Any) -> None:
        # RunSpec(train={...}) reports as the YAML path does: a SpecError naming each field,
        # with "did you mean" for a familiar name, never pydantic's text and URL.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError(_problems(exc)) from None

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):  # "$" alone would accept a trailing newline
            raise ValueError(
                "use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
            )
        return v

    @field_validator("target")
    @classmethod
    def _target_ok(cls, v: str) -> str:
        if not _TARGET_RE.fullmatch(v):
            raise ValueError("use 'local', 'ssh:NAME' or 'slurm:NAME'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        if self.method.kind == "qlora" and self.model.quantization == "none":
            # QLoRA means LoRA on a 4-bit base: make the spec say so instead of failing later.
            object.__setattr__(self.model, "quantization", "4bit")
        res = self.resources
        if res.gpus_per_node > 0 and (res.processes_per_node or 0) > res.gpus_per_node:
            raise ValueError(
                f"resources.processes_per_node ({res.processes_per_node}) is more than "
                f"resources.gpus_per_node ({res.gpus_per_node}): ranks would share a GPU; set "
                "processes_per_node to at most gpus_per_node (or leave it out: one per GPU)"
            )
        m = self.method
        if m.stage == "grpo":
            if not m.rewards:
                raise ValueError("method.stage grpo needs method.rewards, e.g. "
                                 "[{fn: exact_match, column: answer}]")
            per_step = self.train.batch_size * self.train.grad_accum * res.world_size
            if per_step % m.num_generations:
                # TRL samples every prompt's group within one step's completions.
                raise ValueError(
                    f"train.batch_size x grad_accum x processes ({per_step}) must be a multiple "
                    f"of method.num_generations ({m.num_generations}); change either")
        elif m.rewards:
            raise ValueError(f"method.rewards are for method.stage grpo (this is {m.stage}); "
                             "remove them or set method.stage: grpo")
        if self.method.kind != "qlora" and self.model.quantization != "none":
            raise ValueError(
                "model.quantization is only for method.kind 'qlora'; set method.kind: qlora "
                "or model.quantization: none"
            )
        return self

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: Any, source: str | None = None) -> RunSpec:
        """Validate a mapping (e.g. loaded YAML) into a RunSpec, or raise SpecError."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError([("", f"expected a mapping of sections, got {type(data).__name__}")],
                            source)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError(_problems(exc), source) from None

    @classmethod
    def coerce(cls, spec: Any) -> RunSpec:
        """What every entry point accepts: a RunSpec, a mapping, YAML text or a YAML path, or
        None (the embedded default)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            return cls.parse(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_yaml(spec)
        raise SpecError([("", f"expected a RunSpec, a mapping or a YAML path, got "
                              f"{type(spec).__name__}")])

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> RunSpec:
        """Load from YAML text or from a path to a YAML file."""
        source = None
        text = str(text_or_path)
        if isinstance(text_or_path, Path) or (
            "\n" not in text and text.endswith((".yaml", ".yml"))
        ):
            path = Path(text_or_path)
            if not path.is_file():
                raise SpecError([("", f"file {path} does not exist; check the path")], str(path))
            source, text = str(path), path.read_text(encoding="utf-8")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError([("", f"not valid YAML: {exc}")], source) from None
        return cls.parse(data, source)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_yaml(), encoding="utf-8")
        return path

    def updated(self, **changes: Any) -> RunSpec:
        """A copy with dotted-path changes applied, e.g. ``spec.updated(**{"train.lr": 1e-3})``."""
        data = self.model_dump(mode="json")
        for dotted, value in changes.items():
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return RunSpec.parse(data)


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, SpecError):  # RunSpec's own __init__ ran inside this validation
            out += [(".".join(filter(None, (path, p))), m) for p, m in inner.problems]
            continue
        if err["type"] == "extra_forbidden":
            msg = _unknown_field_message(loc)
        elif err["type"] == "literal_error":
            msg = f"got {err['input']!r}; {err['msg'].lower()}"
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
        out.append((path, msg))
    return out


# Names people bring from the Trainer or other tools, mapped to ours.
_FAMILIAR = {"learning_rate": "lr", "num_train_epochs": "epochs", "gradient_accumulation_steps":
             "grad_accum", "per_device_train_batch_size": "batch_size", "r": "lora_r",
             "lora_rank": "lora_r", "gpus": "gpus_per_node", "num_nodes": "nodes"}


def _unknown_field_message(loc: list[str]) -> str:
    model: Any = RunSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            break
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        candidates = [ann, *(inner or ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)),
                     None)
        if model is None:
            break
    allowed = sorted(model.model_fields) if model is not None else []
    name = loc[-1]
    close = [_FAMILIAR[name]] if _FAMILIAR.get(name) in allowed else difflib.get_close_matches(
        name, allowed, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown field '{name}'; {hint}allowed fields: {', '.join(allowed)}"
