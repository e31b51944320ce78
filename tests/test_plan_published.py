"""The planner against published measurements of real fine-tuning runs (docs/planning.md,
"Published reference runs"): each row's setup planned offline, held to its published figures.

Tolerances (the issue's, documented in docs/planning.md):
- strategy: the same kind as the reference: no offload where it ran without; no parameter
  offload where it kept its weights on the card;
- peak memory: within 20 % of the published peak. The published peaks are torch's own counters,
  which do not see the CUDA context, so the plan's fixed 0.9 GiB of it is left out;
- tokens/s: within a factor 1.5 of the published rate, at the per-card utilisation the GPU table
  sets from these same rows (workbench/targets/gpus.py says which row set which card).

torchtune's full fine-tunes train pure bf16 weights with a paged 8-bit AdamW stepped inside
backward; this trainer keeps fp32 master weights and DeepSpeed's offloaded optimizer is what fits
one card, so their tokens/s is known to be missed (strict xfail: a trainer that closes the gap
turns it into a failure to update the docs).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from workbench.plan import plan
from workbench.spec import RunSpec

CUDA_CONTEXT_GIB = 0.9
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"
L8 = "meta-llama/Llama-3.1-8B"
L70 = "meta-llama/Llama-3.1-70B"
# torchtune's llama3_1 LoRA configs: q_proj, v_proj, output_proj and the MLP, dropout 0.
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Reference:
    name: str
    model: str
    kind: str
    gpu: str
    gpus: int
    checkpointing: bool
    lora_r: int
    peak_gib: float
    tokens_per_s: float
    offload: str  # what the reference moved off the card: "none" or "optimizer"
    source: str = TORCHTUNE


# Batch 2 per card, rows packed to 2,048 tokens, no accumulation (torchtune's note on the table).
REFERENCES = [
    Reference("8B LoRA, 1x RTX 4090", L8, "lora", "RTX 4090", 1, True, 8, 16.2, 3083, "none"),
    Reference("8B QLoRA, 1x RTX 4090", L8, "qlora", "RTX 4090", 1, True, 8, 7.4, 2413, "none"),
    Reference("8B full, 1x RTX 4090", L8, "full", "RTX 4090", 1, True, 8, 18.9, 1650,
              "optimizer"),
    # The A6000 rows: 1.5x the 4090's tokens/s on a card of similar peak, and a LoRA peak of
    # 30 GiB, are checkpointing off (one forward less; every layer's activations kept).
    Reference("8B LoRA, 1x RTX A6000", L8, "lora", "RTX A6000", 1, False, 8, 30.3, 4699, "none"),
    Reference("8B full, 1x RTX A6000", L8, "full", "RTX A6000", 1, False, 8, 37.4, 2579,
              "optimizer"),
    Reference("70B LoRA, 8x A100", L70, "lora", "A100-80G", 8, True, 16, 27.6, 3497, "none"),
]


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _plan(ref: Reference):
    data = {
        "model": {"id": ref.model, "quantization": "4bit" if ref.kind == "qlora" else "none"},
        "method": {"kind": ref.kind, "lora_r": ref.lora_r, "lora_alpha": 2 * ref.lora_r,
                   "target_modules": LORA_TARGETS},
        "train": {"batch_size": 2, "gradient_checkpointing": ref.checkpointing,
                  "max_steps": 100},
        "data": {"max_length": 2048, "packing": True},
        "resources": {"gpus_per_node": ref.gpus, "gpu_type": ref.gpu},
    }
    return plan(RunSpec.parse(data))


def _tokens_per_s(p) -> float:
    return p.tokens_per_step / p.clock["step_s"]


@pytest.mark.parametrize("ref", REFERENCES, ids=lambda r: r.name)
def test_same_kind_of_strategy(ref):
    p = _plan(ref)
    assert p.fits, p.summary()
    assert not p.strategy.offload_params, p.summary()  # every reference kept its weights on-card
    if ref.offload == "none":
        assert not p.strategy.offload_optimizer, p.summary()


@pytest.mark.parametrize("ref", REFERENCES, ids=lambda r: r.name)
def test_peak_memory_within_20_percent(ref):
    p = _plan(ref)
    planned = p.memory.total - CUDA_CONTEXT_GIB
    print(f"{ref.name}: planned {planned:.1f} GiB, published {ref.peak_gib} GiB")
    assert planned == pytest.approx(ref.peak_gib, rel=0.20), p.summary()


@pytest.mark.parametrize("ref", [
    pytest.param(r, marks=pytest.mark.xfail(
        strict=True, reason="torchtune trains pure bf16 with a paged 8-bit AdamW stepped in "
        "backward; this trainer needs DeepSpeed's CPU optimizer to fit the card"))
    if r.kind == "full" else r for r in REFERENCES], ids=lambda r: r.name)
def test_tokens_per_second_within_a_factor_1_5(ref):
    p = _plan(ref)
    planned = _tokens_per_s(p)
    print(f"{ref.name}: planned {planned:,.0f} tokens/s, published {ref.tokens_per_s:,}")
    assert 1 / 1.5 <= planned / ref.tokens_per_s <= 1.5, p.summary()


def test_a_24gb_card_plans_8b_lora_like_the_trial_user_runs_it():
    """The issue's case: fits without offload, memory and speed near torchtune's, and the plan
    names the fast paths the trainer will use even for a card it cannot see."""
    p = _plan(REFERENCES[0])
    assert p.strategy.label == "lora + ddp"
    assert "Fast paths: liger on" in p.summary()
    assert any(r.startswith("strategies, reached for in this order: lora + ddp") for r in p.reasons)


def test_parameter_offload_only_when_nothing_else_fits_and_says_how_much_slower():
    # 8B full fine-tuning on a 16 GB T4: its 16-bit weights alone exceed the usable memory.
    t4 = Reference("8B full, 1x T4", L8, "full", "T4", 1, True, 8, 0.0, 0.0, "optimizer")
    p = _plan(t4)
    assert p.fits and p.strategy.offload_params, p.summary()
    slower = [r for r in p.reasons if r.startswith("parameter offload is ")]
    assert slower and "x slower than full + zero2 + offload optimizer" in slower[0], p.reasons
    # On the 4090 the optimizer offload fits, so parameter offload is not chosen, though faster
    # ones are listed first.
    p4090 = _plan(REFERENCES[2])
    assert p4090.strategy.label == "full + zero2 + offload optimizer", p4090.summary()
