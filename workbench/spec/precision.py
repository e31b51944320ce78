"""Precision of a run: the dtype weights are loaded in, the autocast (AMP) mode, and whether the
trained parameters and their optimizer state stay fp32 — decided once, here, for the planner
(bytes per weight) and the trainer (``from_pretrained`` dtype, ``TrainingArguments`` bf16/fp16).

The rules, and why:

* **Full fine-tuning keeps fp32 master weights.** Adam updates are often below bf16's resolution
  (8 bits of mantissa: ``1.0 + 1e-3 == 1.0`` in bf16), so pure-bf16 weights silently stop
  learning. Weights are loaded fp32 and the forward/backward run under bf16 (or fp16) autocast;
  under DeepSpeed ZeRO the engine casts the module to 16 bits and keeps its own fp32 master copy.
* **Unless the run says otherwise.** ``train.master_weights: none`` trains pure bf16 weights (half
  the bytes of fp32 ones, the updates too small for bf16 lost); ``auto`` does so only with the
  optimizer stepped inside backward on a bf16 GPU (:mod:`workbench.spec.stepping`), the recipe
  that fits an 8B full fine-tune on a 24 GB card. Pure 16-bit weights are bf16 only: fp16 ones
  would need a loss scaler, whose unscaling waits for every gradient.
* **The optimizer stepped in backward needs gradients at their true scale**, so it is refused
  with fp16 autocast (a card without bf16), whose loss scaler unscales only before ``step()``.
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


def sixteen_bit_weights(master_weights: str, dtype: str, method: str, device: DeviceKind,
                        in_backward: bool) -> bool:
    """Whether a run trains pure 16-bit weights: ``train.master_weights`` none, or ``auto``
    with the optimizer stepped in backward on a bf16 GPU (``model.dtype`` auto or bfloat16)."""
    if method != "full" or master_weights == "fp32":
        return False
    if master_weights == "none":
        return True
    return in_backward and device == "cuda-bf16" and dtype in ("auto", "bfloat16")


def resolve_precision(dtype: str, method: str, device: DeviceKind, *, in_backward: bool = False,
                      master_weights: str = "auto") -> Precision:
    """The precision of a run with ``model.dtype`` ``dtype`` and ``method.kind`` ``method`` on
    ``device``, its optimizer stepped in backward or not, with ``train.master_weights``.
    Raises SpecError for bf16 on a card without it, for pure 16-bit weights where they cannot
    train, and for the optimizer stepped in backward under fp16 loss scaling."""
    full = method == "full"
    if sixteen_bit_weights(master_weights, dtype, method, device, in_backward):
        if device != "cuda-bf16":
            raise SpecError([("train.master_weights", "pure 16-bit weights train in bf16, on a "
                              "GPU that has it (not on CPU, V100 or T4): set "
                              "train.master_weights: auto (or fp32)")])
        return Precision("bfloat16", "bf16", False,
                         "full fine-tuning with pure bf16 weights (train.master_weights "
                         f"{master_weights}{', optimizer in backward' if in_backward else ''}): "
                         "no fp32 master copy, so updates below bf16's resolution (~1/256 of "
                         "a weight) are lost")
    if in_backward and device == "cuda-fp16" and dtype != "float32":
        raise SpecError([("train.optimizer_in_backward", "this GPU has no bf16, and fp16's loss "
                          "scaler unscales the gradients only before the optimizer's step, "
                          "after a step in backward has used them: set "
                          "train.optimizer_in_backward: false (or auto)")])
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
