"""Published measurements of real fine-tuning runs, as data: each row's setup as its source states
it and the peak memory and tokens/s it published (docs/planning.md, "Published reference runs").

Nothing here is computed by the planner: ``tests/test_plan_published.py`` holds the plan of each
row to its published figures, and ``bench/gpu_published.py`` runs each row's setup on a lent GPU
and records planned, measured and published side by side.

    >>> row = REFERENCES[0]
    >>> row.name, row.peak_gib, row.tokens_per_s
    ('8B LoRA, 1x RTX 4090', 16.2, 3083)
    >>> row.spec(gpu_type="H200").resources.gpu_type
    'H200'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.spec import RunSpec

TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"
L8 = "meta-llama/Llama-3.1-8B"
L70 = "meta-llama/Llama-3.1-70B"
# torchtune's llama3_1 LoRA configs: q_proj, v_proj, output_proj and the MLP, dropout 0.
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# torchtune's note on its table: batch 2 per card, rows packed to 2,048 tokens, no accumulation.
BATCH, SEQ = 2, 2048


@dataclass(frozen=True)
class Reference:
    """One published run: its setup, and its peak memory (torch's counters, GiB) and tokens/s
    (all cards together) on ``gpus`` x ``gpu``."""

    name: str
    model: str
    kind: str  # "lora", "qlora" or "full"
    gpu: str  # the GPU table's name of the card it ran on
    gpus: int
    checkpointing: bool
    lora_r: int
    peak_gib: float
    tokens_per_s: float
    offload: str  # what the reference moved off the card: "none" or "optimizer"
    in_backward: bool = False  # its optimizer stepped inside backward (torchtune's optimizer_in_bwd)
    source: str = TORCHTUNE

    def spec(self, gpu_type: str | None = None, **changes: Any) -> RunSpec:
        """The run spec of this setup on its card (or ``gpu_type``), the strategy left to the
        planner; ``changes`` are dotted spec fields (``RunSpec.updated``)."""
        spec = RunSpec.parse({
            "model": {"id": self.model,
                      "quantization": "4bit" if self.kind == "qlora" else "none"},
            "method": {"kind": self.kind, "lora_r": self.lora_r, "lora_alpha": 2 * self.lora_r,
                       "target_modules": LORA_TARGETS},
            "train": {"batch_size": BATCH, "gradient_checkpointing": self.checkpointing,
                      "max_steps": 100},
            "data": {"max_length": SEQ, "packing": True},
            "resources": {"gpus_per_node": self.gpus, "gpu_type": gpu_type or self.gpu},
        })
        return spec.updated(**changes) if changes else spec

    def stated_spec(self, gpu_type: str | None = None, **changes: Any) -> RunSpec:
        """:meth:`spec` with the optimizer the source states given, not chosen: AdamW for the
        LoRA rows; for the full rows torchtune's bf16 weights (no fp32 masters) and
        bitsandbytes' paged 8-bit AdamW stepped inside backward."""
        stated: dict[str, Any] = {"train.optimizer": "adamw",
                                  "train.optimizer_in_backward": False}
        if self.kind == "full":
            stated = {"train.optimizer": "paged_adamw_8bit",
                      "train.optimizer_in_backward": True, "train.master_weights": "none"}
        if self.gpus == 1:
            stated["parallel.strategy"] = "ddp"
        return self.spec(gpu_type, **stated, **changes)


REFERENCES = [
    Reference("8B LoRA, 1x RTX 4090", L8, "lora", "RTX 4090", 1, True, 8, 16.2, 3083, "none"),
    Reference("8B QLoRA, 1x RTX 4090", L8, "qlora", "RTX 4090", 1, True, 8, 7.4, 2413, "none"),
    # The full fine-tunes: bf16 weights, bitsandbytes' PagedAdamW8bit (its states in unified
    # memory, paged to host RAM) stepped inside backward.
    Reference("8B full, 1x RTX 4090", L8, "full", "RTX 4090", 1, True, 8, 18.9, 1650,
              "optimizer", True),
    # The A6000 rows: 1.5x the 4090's tokens/s on a card of similar peak, and a LoRA peak of
    # 30 GiB, are checkpointing off (one forward less; every layer's activations kept).
    Reference("8B LoRA, 1x RTX A6000", L8, "lora", "RTX A6000", 1, False, 8, 30.3, 4699, "none"),
    Reference("8B full, 1x RTX A6000", L8, "full", "RTX A6000", 1, False, 8, 37.4, 2579,
              "optimizer", True),
    Reference("70B LoRA, 8x A100", L70, "lora", "A100-80G", 8, True, 16, 27.6, 3497, "none"),
]
