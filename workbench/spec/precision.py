"""Precision of a run: the dtype weights are loaded in, the autocast (AMP) mode, and whether the
trained parameters and their optimizer state stay fp32 — decided once, here, for the planner
(bytes per weight) and the trainer (``from_pretrained`` dtype, ``TrainingArguments`` bf16/fp16).

The rules, and why:

* **Full fine-tuning keeps fp32 master weights.** Adam updates are often below bf16's resolution
  (8 bits of mantissa: ``1.0 + 1e-3 == 1.0`` in bf16), so pure-bf16 weights silently stop
  learning. Weights are loaded fp32 and the forward/backward run under bf16 (or fp16) autocast;
  under DeepSpeed ZeRO the engine casts the module to 16 bits and keeps its own fp32 master copy.
* **LoRA / QLoRA load the frozen base in 16 bits** (it never changes, so precision loss cannot
  accumulate) while peft keeps the adapters, their gradients and Adam state in fp32.
* **Cards without bf16** (V100, T4: compute capability < 8.0) train with fp16 autocast and a loss
  scaler; asking them for bf16 is refused rather than emulated slowly.
* **CPU** trains fp32 (``auto``); an explicit 16-bit ``model.dtype`` loads a LoRA base in it, but a
  full fine-tune stays fp32, since CPU autocast would not keep master weights for it either.

``model.dtype`` therefore names the *compute* dtype; ``auto`` means bf16 on a bf16 GPU, fp16 on an
older GPU, fp32 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workbench.errors import SpecError

DeviceKind = Literal["cpu", "cuda-bf16", "cuda-fp16"]
DType = Literal["float32", "bfloat16", "float16"]
Amp = Literal["bf16", "fp16", "none"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_AMP = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Precision:
    """What a run's weights, compute and trained state are held in, with the reason."""

    load_dtype: DType  # ``from_pretrained(dtype=...)``; for QLoRA the non-quantised layers
    amp: Amp  # autocast of forward/backward: TrainingArguments bf16= / fp16=
    fp32_trainable: bool  # trained params (full: master weights; LoRA: adapters) + Adam in fp32
    reason: str

    @property
    def compute_dtype(self) -> DType:
        """The dtype matmuls run in (bitsandbytes' ``bnb_4bit_compute_dtype`` too)."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.amp, self.load_dtype)  # type: ignore[return-value]

    @property
    def compute_bytes(self) -> int:
        return _BYTES[self.compute_dtype]

    @property
    def load_bytes(self) -> int:
        return _BYTES[self.load_dtype]


def resolve_precision(dtype: str, method: str, device: DeviceKind) -> Precision:
    """The precision of a run with ``model.dtype`` ``dtype`` and ``method.kind`` ``method`` on
    ``device``. Raises SpecError for bf16 on a card without it."""
    full = method == "full"
    if device == "cpu":
        if dtype in ("auto", "float32"):
            return Precision("float32", "none", True, "CPU: fp32 throughout")
        if full:
            return Precision("float32", "none", True,
                             f"CPU full fine-tuning: fp32 weights (model.dtype {dtype} would "
                             "lose small updates without fp32 master weights)")
        return Precision(dtype, "none", True,  # type: ignore[arg-type]
                         f"CPU: frozen base in {dtype} as model.dtype says, adapters fp32")
    if dtype == "float32":
        return Precision("float32", "none", True, "model.dtype float32: fp32 throughout, no AMP")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda-bf16" else "float16"
    elif dtype == "bfloat16" and device == "cuda-fp16":
        raise SpecError([("model.dtype", "this GPU has no bf16 (V100/T4 class, compute "
                                         "capability < 8.0): set model.dtype: auto or float16")])
    amp: Amp = _AMP[dtype]  # type: ignore[assignment]
    card = "bf16 GPU" if device == "cuda-bf16" else "GPU without bf16"
    if full:
        return Precision("float32", amp, True,
                         f"full fine-tuning on a {card}: fp32 master weights and Adam state, "
                         f"{amp} autocast (16-bit weights would lose small updates)")
    return Precision(dtype, amp, True,  # type: ignore[arg-type]
                     f"{method} on a {card}: frozen base in {dtype}, adapters and Adam state "
                     f"fp32, {amp} autocast")


def local_device_kind() -> DeviceKind:
    """This process's device kind, from torch (imported here, only when called)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "cuda-bf16" if torch.cuda.is_bf16_supported() else "cuda-fp16"
