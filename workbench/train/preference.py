"""The TRL side of the stages after SFT: rows, config and trainer for dpo, orpo, kto and grpo.

:mod:`workbench.train.run` stays the one training path: it asks this module, for a non-SFT
``method.stage``, for the rows (the normalised jsonl that :mod:`workbench.data.preference` wrote
at launch; TRL tokenises them with the model's chat template), the TRL config (built by
:func:`workbench.train.arguments.training_arguments`, passed in, so precision, strategy, logging,
evaluation and DeepSpeed are the same as SFT's) and the trainer class and its extra arguments
(reference model, reward functions). The run's own callbacks, snapshots, budget stop and resume
then work unchanged, because the TRL trainer is wrapped by the same ``SnapshottingTrainer``. TRL
implements every loss; nothing here re-implements one.

    >>> cls = trainer_base(RunSpec(method={"stage": "dpo"}))  # doctest: +SKIP
    >>> cls.__name__
    'DPOTrainer'
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec

# TRL's experimental ORPO warns on import; the spec already says the stage is ORPO.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
_GRPO_BETA = 0.04  # the KL weight of the DeepSeekMath GRPO paper: KL stays visible in metrics


def load_rows(rd: RunDir, split: str) -> Any:
    """A split's normalised rows as a ``datasets.Dataset`` (empty when the split has none)."""
    import datasets

    path = rd.data_dir / f"{split}.jsonl"
    rows = []
    stage = rd.spec().method.stage
    # Evaluating GRPO means sampling every validation prompt: its held-out prompts stay unused.
    if path.is_file() and not (stage == "grpo" and split == "validation"):
        with path.open(encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    print(f"data: {split} {len(rows)} {stage} rows from {path}", flush=True)
    return datasets.Dataset.from_list(rows)


def beta(spec: RunSpec) -> float:
    m = spec.method
    return m.beta if m.beta is not None else (_GRPO_BETA if m.stage == "grpo" else 0.1)


def arguments(spec: RunSpec, rd: RunDir, has_eval: bool,
              training_arguments: Callable[..., Any]) -> Any:
    """The stage's TRL config, built by ``training_arguments`` (passed in by run.py) over the same
    base arguments as SFT."""
    m, d = spec.method, spec.data
    extra: dict[str, Any] = {"beta": beta(spec)}
    if m.stage in ("dpo", "kto", "orpo"):
        extra["max_length"] = d.max_length
    if m.loss_type is not None:
        extra["loss_type"] = [m.loss_type] if m.stage == "dpo" else m.loss_type
    if m.stage == "dpo":
        from trl import DPOConfig as cls
    elif m.stage == "kto":
        from trl import KTOConfig as cls  # type: ignore[assignment]
    elif m.stage == "orpo":
        from trl.experimental.orpo import ORPOConfig as cls  # type: ignore[assignment]
    else:
        from trl import GRPOConfig as cls  # type: ignore[assignment]

        extra.update(num_generations=m.num_generations,
                     max_completion_length=m.max_completion_length, temperature=m.temperature,
                     reward_weights=[r.weight for r in m.rewards])
    args = training_arguments(spec, rd, has_eval, args_class=cls, **extra)
    # Preference batches hold prompt/chosen/rejected ids, not one input_ids: TRL counts tokens.
    args.include_num_input_tokens_seen = "no"
    return args


def trainer_base(spec: RunSpec) -> type:
    stage = spec.method.stage
    if stage == "dpo":
        from trl import DPOTrainer

        return DPOTrainer
    if stage == "kto":
        from trl import KTOTrainer

        return KTOTrainer
    if stage == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        return ORPOTrainer
    from trl import GRPOTrainer

    return GRPOTrainer


def reference_model(spec: RunSpec, source: str) -> Any:
    """An explicit frozen reference for dpo/kto, or None where TRL needs none from us: a LoRA
    policy's reference is its base with the adapter switched off (no second copy)."""
    m = spec.method
    if m.stage not in ("dpo", "kto"):
        return None  # orpo has none; grpo's (beta > 0) is TRL's own, implicit under LoRA
    if m.reference == "auto" and m.kind != "full":
        print("reference: implicit (the base with the LoRA adapter switched off)", flush=True)
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.spec.precision import local_device_kind, resolve_precision

    p = resolve_precision(spec.model.dtype, "full" if m.kind == "full" else "lora",
                          local_device_kind())
    ref = AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, p.compute_dtype), revision=spec.model.revision,
        trust_remote_code=spec.model.trust_remote_code)
    ref.eval().requires_grad_(False)
    print(f"reference: explicit frozen copy of {spec.model.id} ({p.compute_dtype})", flush=True)
    return ref


def trainer_kwargs(spec: RunSpec, tokenizer: Any, source: str, rd: RunDir) -> dict[str, Any]:
    """What the stage's TRL trainer takes besides model/args/data/callbacks."""
    kwargs: dict[str, Any] = {"processing_class": tokenizer}
    if spec.method.stage == "grpo":
        from workbench.train.rewards import check_rewards, use_shipped_rewards

        use_shipped_rewards(rd.data_dir)  # the user rewards' code as launch checked it

        kwargs["reward_funcs"] = check_rewards(spec.method.rewards,
                                               {r.column for r in spec.method.rewards})
    elif spec.method.stage in ("dpo", "kto"):
        kwargs["ref_model"] = reference_model(spec, source)
    return kwargs
