"""What a training stage adds to SFT's memory and time: reference model, pairs, generations.

The planner prices SFT; :func:`stage_cost` says how ``method.stage`` changes that, and the plan's
reasons carry its notes. dpo/orpo put a chosen and a rejected sequence through the policy for
every example (twice the activations at max_length); dpo/kto compare against a frozen reference
(a forward pass with no gradient; a second copy of the weights only when it is explicit, since a
LoRA policy's reference is its own base with the adapter switched off); orpo needs none; grpo
samples ``num_generations`` completions per prompt, token by token, before each step (plus a
reference pass when its KL weight ``beta`` is above 0).

    >>> stage_cost(RunSpec(method={"stage": "dpo", "kind": "full"}), 40.0).reference_copy
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workbench.plan.memory import GiB, MemoryBreakdown
from workbench.plan.shape import ModelShape
from workbench.plan.timing import DataEstimate
from workbench.spec import RunSpec

# Decoding one token at a time reads every weight per token for a handful of rows: memory-bound,
# far below the utilisation a training step reaches. 8x slower per token than a training forward
# is the order seen for HF generate() at small batch (TRL's GRPO without vLLM); a rough figure.
_DECODE_SLOWDOWN = 8.0


@dataclass(frozen=True)
class StageCost:
    sequences: int = 1  # sequences per example through the policy (2: chosen and rejected)
    reference_pass: bool = False  # one gradient-free forward of a reference per example
    reference_copy: bool = False  # that reference is a second copy of the weights in memory
    generated_tokens: int = 0  # tokens decoded per training sequence before the step (grpo)
    notes: list[str] = field(default_factory=list)


def stage_cost(spec: RunSpec, tokens_per_example: float) -> StageCost:
    m = spec.method
    if m.stage == "sft":
        return StageCost()
    beta = m.beta if m.beta is not None else (0.04 if m.stage == "grpo" else 0.1)
    ref = m.stage in ("dpo", "kto") or (m.stage == "grpo" and beta > 0)
    copy = ref and (m.reference == "explicit" or m.kind == "full")
    notes = []
    if m.stage == "orpo":
        notes.append("orpo: no reference model (the odds ratio needs none)")
    elif ref:
        notes.append(f"{m.stage}: reference model " + (
            "as a second frozen copy of the weights (in memory) + a forward pass per example"
            if copy else "implicit (the base with the LoRA adapter off): no second copy, one "
            "more forward pass per example"))
    else:
        notes.append("grpo: beta 0, so no reference model and no KL term")
    sequences = 2 if m.stage in ("dpo", "orpo") else 1
    if sequences == 2:
        notes.append(f"{m.stage}: chosen and rejected go through the model together: twice the "
                     "activations of one example")
    generated = 0
    if m.stage == "grpo":
        generated = m.max_completion_length
        notes.append(f"grpo: {m.num_generations} completions per prompt, up to "
                     f"{m.max_completion_length} tokens each, generated token by token before "
                     f"every step (counted as forward passes {_DECODE_SLOWDOWN:g}x slower than "
                     "training's)")
    return StageCost(sequences, ref, copy, generated, notes)


def stage_data(spec: RunSpec, data: DataEstimate) -> DataEstimate:
    """What a training step sees of the data under ``method.stage``. GRPO's rows are prompts, but
    it trains on each prompt *with* a generated completion (up to ``max_completion_length``
    tokens), and TRL repeats every prompt ``num_generations`` times per epoch (a batch counts
    completions): the planner would otherwise price a prompt's tokens once per epoch."""
    m = spec.method
    if m.stage != "grpo":
        return data
    rows = data.rows * m.num_generations if data.rows is not None else None
    longest = data.longest + m.max_completion_length if data.longest is not None else None
    return replace(
        data, rows=rows, longest=longest,
        tokens_per_example=data.tokens_per_example + m.max_completion_length,
        note=(f"{data.note}; grpo: each prompt trained with its completion (+"
              f"{m.max_completion_length} tokens), {m.num_generations} completions per prompt "
              "per epoch"))


def stage_memory(mem: MemoryBreakdown, cost: StageCost, shape: ModelShape, compute_bytes: int,
                 shards: int) -> MemoryBreakdown:
    """``mem`` with the stage's extra activations and reference weights (sharded over ``shards``
    ranks under ZeRO-3, as DeepSpeed shards every engine's parameters)."""
    extra = shape.params * compute_bytes / GiB / shards if cost.reference_copy else 0.0
    return replace(mem, weights=mem.weights + extra,
                   activations=mem.activations * cost.sequences)


def stage_time_factor(cost: StageCost, method: str, tokens_per_example: float) -> float:
    """Step time relative to SFT on the same tokens (a forward is ~1/3 of full fine-tuning's
    forward + backward, ~1/2 of LoRA's, whose frozen weights get no weight gradient)."""
    forward_share = 1 / 3 if method == "full" else 1 / 2
    factor = 1.0
    if cost.reference_pass:
        factor += forward_share
    if cost.generated_tokens:
        factor += (cost.generated_tokens / max(1.0, tokens_per_example) * forward_share
                   * _DECODE_SLOWDOWN)
    return factor
