"""RunSpec: the one validated, serialisable description of a fine-tuning run.

Every front end (widgets, magics, CLI, lab panel) builds a :class:`RunSpec` and hands it to the
same library calls. A spec round-trips through YAML (``RunSpec.from_yaml`` / ``to_yaml``) and every
validation problem is reported as a :class:`~workbench.errors.SpecError` naming the field path and
what to do, e.g. ``train.lr: must be greater than 0``.

    >>> spec = RunSpec(name="demo", train={"max_steps": 10})
    >>> RunSpec.from_yaml(spec.to_yaml()) == spec
    True

The sections it is made of live in :mod:`workbench.spec.sections`; the section classes are
re-exported here (they are public API: ``from workbench.spec import DataSource``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from workbench.errors import SpecError
from workbench.spec.problems import problems
from workbench.spec.sections import (
    BUILTIN_DATASET,
    BUILTIN_MODEL,
    EVALS_PER_RUN,
    BudgetSpec,
    CheckpointSpec,
    CleanSpec,
    DataSource,
    DataSpec,
    EvalSpec,
    EvalTask,
    FastSpec,
    MethodSpec,
    ModelSpec,
    ParallelSpec,
    ResourceSpec,
    RewardSpec,
    Section,
    ServeSpec,
    TrackingSpec,
    TrainSpec,
)
from workbench.spec.stepping import stepping_problem

__all__ = [
    "BUILTIN_DATASET", "BUILTIN_MODEL", "EVALS_PER_RUN", "BudgetSpec", "CheckpointSpec",
    "CleanSpec", "DataSource", "DataSpec", "EvalSpec", "EvalTask", "FastSpec", "MethodSpec",
    "ModelSpec", "ParallelSpec", "ResourceSpec", "RewardSpec", "RunSpec", "ServeSpec",
    "TrackingSpec", "TrainSpec",
]

# Used with fullmatch: "$" alone accepts a trailing newline, which would break an #SBATCH line.
_TARGET_RE = re.compile(r"local|(ssh|slurm):[A-Za-z0-9_.-]+")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunSpec(Section):
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
            raise SpecError(problems(exc, RunSpec)) from None

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
        stepping = stepping_problem(self.model, m, self.train, self.parallel, res)
        if stepping is not None:
            raise ValueError(stepping)
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
            raise SpecError(problems(exc, RunSpec), source) from None

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

