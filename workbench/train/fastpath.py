"""The training fast paths of a run: Liger kernels, the attention kernel, fused AdamW and TF32,
decided once, here, from ``train.fast`` and a description of the device, for the planner (what
the plan shows) and the trainer (``TrainingArguments`` and ``from_pretrained`` arguments).

The rules, and why:

* **Liger** (``liger-kernel``: Triton kernels for RMSNorm, SwiGLU, RoPE and a fused
  linear + cross-entropy loss that never materialises the logits) needs a CUDA device, the package
  (``pip install 'workbench[gpu]'``) and a model type Liger patches. Under ZeRO-3 its fused loss
  would read the partitioned ``lm_head`` weight directly (an empty shard), so there the fused loss
  is left out and the other kernels kept. Preference stages (dpo/kto/grpo/orpo) switch TRL to
  its own Liger losses, so ``auto`` leaves them alone; ``on`` asks for them.
* **Attention**: flash-attention 2 where ``flash-attn`` is installed, the card is Ampere or newer
  and the weights are 16-bit (it has no fp32 kernels: a full fine-tune with fp32 master weights
  gets SDPA, whose own flash kernel runs under bf16 autocast); otherwise transformers' default,
  SDPA where the model has it.
* **Fused AdamW** (``adamw_torch_fused``: one kernel for every parameter instead of a loop) on
  CUDA, except when DeepSpeed offloads the optimizer (it steps the offloaded state itself); on CPU
  the plain ``adamw_torch``, so a CPU run asks for nothing built for a GPU. ``train.optimizer``
  ``adamw_8bit`` / ``paged_adamw_8bit`` asks for bitsandbytes' 8-bit AdamW instead (CUDA and the
  ``bitsandbytes`` package; refused clearly where either is missing, before anything trains).
* **TF32** on compute capability 8.0+ (A100, H100, RTX 30xx/40xx): fp32 matmuls (LoRA adapters,
  fp32 runs) on tensor cores; never on CPU or older cards.

``on`` where a switch cannot work is a :class:`~workbench.errors.FastPathError` saying what to
change; ``auto`` falls back with the reason in :attr:`FastPaths.notes`.

    >>> fp = resolve_fast_paths(FastSpec(), Device(cuda=False), "llama", "float32")
    >>> fp.line()
    'fast paths: liger off, attention default, adamw, tf32 off'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import FastPathError
from workbench.spec import RunSpec
from workbench.spec.sections import FastSpec

GPU_EXTRA = "pip install 'workbench[gpu]'"


@dataclass(frozen=True)
class Device:
    """Where training runs, as far as the fast paths care.

    ``liger_types``: the model types the installed liger-kernel patches (None: not read here;
    the trainer reads them where it trains); ``known=False``: what is installed there is not known
    (planning for a remote target), so package-dependent switches are stated as conditional.
    """

    cuda: bool
    capability: tuple[int, int] | None = None  # (8, 0) for an A100
    liger: bool = False  # liger-kernel installed
    liger_types: frozenset[str] | None = None
    flash_attn: bool = False  # flash-attn installed
    known: bool = True
    bitsandbytes: bool = False  # bitsandbytes installed (8-bit optimizers)


@dataclass(frozen=True)
class FastPaths:
    """What the trainer turns on, with one note per switch saying why."""

    liger: bool
    liger_config: dict[str, bool] | None  # TrainingArguments.liger_kernel_config
    attention: str | None  # from_pretrained(attn_implementation=...); None: transformers' choice
    optim: str
    tf32: bool | None  # TrainingArguments.tf32; None leaves torch's setting
    notes: tuple[str, ...] = field(default=())

    def line(self) -> str:
        """One line for the plan, e.g. ``fast paths: liger on, sdpa, fused adamw, tf32 on``."""
        return _line(self.liger, self.liger_config, self.attention or "attention default",
                     self.optim, self.tf32)

    def training_kwargs(self) -> dict[str, Any]:
        """The ``TrainingArguments`` these paths set."""
        kw: dict[str, Any] = {"use_liger_kernel": self.liger, "optim": self.optim}
        if self.liger_config is not None:
            kw["liger_kernel_config"] = self.liger_config
        if self.tf32 is not None:
            kw["tf32"] = self.tf32
        return kw

    def model_kwargs(self) -> dict[str, Any]:
        """The ``from_pretrained`` arguments these paths set."""
        return {"attn_implementation": self.attention} if self.attention else {}

    def to_dict(self) -> dict[str, Any]:
        return {"liger": self.liger, "liger_config": self.liger_config,
                "attention": self.attention, "optim": self.optim, "tf32": self.tf32,
                "notes": list(self.notes)}


def _line(liger: bool, liger_config: dict[str, bool] | None, attention: str, optim: str,
          tf32: bool | None) -> str:
    return ", ".join([
        "fast paths: " + ("liger off" if not liger else
                          "liger on (no fused loss)" if liger_config and not liger_config.get(
                              "fused_linear_cross_entropy", True) else "liger on"),
        attention, _OPTIM_WORDS.get(optim, "adamw"),
        "tf32 on" if tf32 else "tf32 off"])


_OPTIM_WORDS = {"adamw_torch_fused": "fused adamw", "adamw_bnb_8bit": "8-bit adamw",
                "paged_adamw_8bit": "paged 8-bit adamw"}
# train.optimizer -> TrainingArguments.optim (bitsandbytes' AdamW8bit / PagedAdamW8bit).
BNB_OPTIM = {"adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}


def applied_line(args: Any, model: Any) -> str:
    """The line for a run's log and status.json, read from what the Trainer was given
    (``TrainingArguments``) and the attention kernel the loaded model really uses."""
    return _line(bool(args.use_liger_kernel), args.liger_kernel_config,
                 getattr(model.config, "_attn_implementation", None) or "attention default",
                 str(getattr(args.optim, "value", args.optim)), args.tf32)


def resolve_fast_paths(fast: FastSpec, device: Device, model_type: str | None, load_dtype: str,
                       *, stage: str = "sft", zero_stage: int = 0,
                       offload_optimizer: bool = False, optimizer: str = "adamw") -> FastPaths:
    """The fast paths of a run with switches ``fast`` on ``device`` for a model of
    ``model_type`` loaded in ``load_dtype`` (workbench.spec.precision), stepping ``optimizer``
    (``train.optimizer`` as resolved: adamw, adamw_8bit or paged_adamw_8bit). Raises
    FastPathError for a switch set ``on``, or an 8-bit optimizer, that cannot work there."""
    notes: list[str] = []
    liger, liger_config = _liger(fast.liger, device, model_type, stage, zero_stage, notes)
    attention = _attention(fast.attention, device, load_dtype, notes)
    optim = (_bnb_optim(optimizer, device, zero_stage, notes) if optimizer in BNB_OPTIM
             else _optim(fast.fused_adamw, device, offload_optimizer, notes))
    tf32 = _tf32(fast.tf32, device, notes)
    return FastPaths(liger, liger_config, attention, optim, tf32, tuple(notes))


def _liger(switch: str, device: Device, model_type: str | None, stage: str, zero_stage: int,
           notes: list[str]) -> tuple[bool, dict[str, bool] | None]:
    if switch == "off":
        notes.append("liger off: train.fast.liger is off")
        return False, None
    why_not = None
    if not device.cuda:
        why_not = "Liger's Triton kernels need a CUDA GPU"
    elif device.known and not device.liger:
        why_not = f"liger-kernel is not installed ({GPU_EXTRA})"
    elif (device.liger_types is not None and model_type is not None
          and model_type not in device.liger_types):
        why_not = f"liger-kernel has no kernels for model type {model_type!r}"
    if why_not is not None:
        if switch == "on":
            raise FastPathError(f"train.fast.liger is on, but {why_not}: set train.fast.liger: "
                                "auto (or off)")
        notes.append(f"liger off: {why_not}")
        return False, None
    if switch == "auto" and stage != "sft":
        notes.append(f"liger off: stage {stage} would switch to TRL's own Liger losses; set "
                     "train.fast.liger: on to use them")
        return False, None
    where = "" if device.known else " (if liger-kernel is installed on the target)"
    if zero_stage == 3:
        notes.append(f"liger on{where}: RMSNorm/SwiGLU/RoPE kernels; no fused loss under ZeRO-3 "
                     "(it would read the partitioned lm_head weight)")
        return True, {"fused_linear_cross_entropy": False}
    notes.append(f"liger on{where}: RMSNorm/SwiGLU/RoPE kernels and the fused linear "
                 "cross-entropy (logits never materialised)")
    return True, None


def _attention(switch: str, device: Device, load_dtype: str, notes: list[str]) -> str | None:
    if switch in ("sdpa", "eager"):
        notes.append(f"attention {switch}: train.fast.attention says so")
        return switch
    why_not = None
    if not device.cuda:
        why_not = "flash-attention 2 needs a CUDA GPU"
    elif device.capability is not None and device.capability < (8, 0):
        why_not = "flash-attention 2 needs an Ampere or newer card (compute capability 8.0+)"
    elif load_dtype == "float32":
        why_not = "flash-attention 2 has no fp32 kernels and the weights load fp32"
    elif device.known and not device.flash_attn:
        why_not = "flash-attn is not installed"
    if switch == "flash_attention_2":
        if why_not is not None:
            raise FastPathError(f"train.fast.attention is flash_attention_2, but {why_not}: set "
                                "train.fast.attention: auto (or sdpa)")
        notes.append("attention flash_attention_2: train.fast.attention says so")
        return "flash_attention_2"
    if switch == "auto" and why_not is None:
        where = "" if device.known else " (if flash-attn is installed on the target, else sdpa)"
        notes.append(f"attention flash_attention_2{where}: 16-bit weights on an Ampere+ card")
        return "flash_attention_2"
    notes.append("attention default (sdpa where the model has it)"
                 + (f": {why_not}" if switch == "auto" else ": train.fast.attention is default"))
    return None


def _optim(switch: str, device: Device, offload_optimizer: bool, notes: list[str]) -> str:
    if switch == "off":
        notes.append("adamw: train.fast.fused_adamw is off")
        return "adamw_torch"
    why_not = None
    if not device.cuda:
        why_not = "on CPU the plain torch AdamW"
    elif offload_optimizer:
        why_not = "DeepSpeed steps the offloaded optimizer itself"
    if why_not is not None:
        if switch == "on" and device.cuda:
            raise FastPathError(f"train.fast.fused_adamw is on, but {why_not}: set "
                                "train.fast.fused_adamw: auto, or parallel.offload_optimizer: false")
        if switch == "on":
            raise FastPathError("train.fast.fused_adamw is on, but fused AdamW is a CUDA fast "
                                "path and this run trains on CPU: set train.fast.fused_adamw: auto")
        notes.append(f"adamw: {why_not}")
        return "adamw_torch"
    notes.append("fused adamw: one kernel steps every parameter")
    return "adamw_torch_fused"


def _bnb_optim(optimizer: str, device: Device, zero_stage: int, notes: list[str]) -> str:
    why_not = None
    if not device.cuda:
        why_not = "bitsandbytes' 8-bit optimizers need a CUDA GPU"
    elif device.known and not device.bitsandbytes:
        why_not = "bitsandbytes is not installed where it trains (pip install bitsandbytes)"
    elif zero_stage:
        why_not = "DeepSpeed ZeRO steps its own optimizer: use parallel.strategy ddp (or auto)"
    if why_not is not None:
        raise FastPathError(f"train.optimizer is {optimizer}, but {why_not}; or set "
                            "train.optimizer: auto (or adamw)")
    where = "" if device.known else " (if bitsandbytes is installed on the target)"
    paged = (": its states page to host RAM when the card is short"
             if optimizer == "paged_adamw_8bit" else "")
    notes.append(f"{_OPTIM_WORDS[BNB_OPTIM[optimizer]]}{where}: Adam's moments in 8 bits{paged}")
    return BNB_OPTIM[optimizer]


def _tf32(switch: str, device: Device, notes: list[str]) -> bool | None:
    if switch == "off":
        notes.append("tf32 off: train.fast.tf32 is off")
        return False if device.cuda and _ampere(device) else None
    if device.cuda and _ampere(device):
        notes.append("tf32 on: fp32 matmuls on tensor cores (Ampere or newer)")
        return True
    why = "a CUDA GPU of compute capability 8.0+" if device.cuda else "a CUDA GPU"
    if switch == "on":
        raise FastPathError(f"train.fast.tf32 is on, but TF32 needs {why}: set "
                            "train.fast.tf32: auto")
    notes.append(f"tf32 off: it needs {why}")
    return None


def _ampere(device: Device) -> bool:
    # Unknown capability (planning a card the table marks bf16-capable) counts as Ampere+.
    return device.capability is None or device.capability >= (8, 0)


def local_device() -> Device:
    """This process's device and what is installed here (imports torch; liger only if there)."""
    import torch

    if not torch.cuda.is_available():
        return Device(cuda=False)
    liger_types = None
    liger = importlib.util.find_spec("liger_kernel") is not None
    if liger:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        liger_types = frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)
    return Device(cuda=True, capability=torch.cuda.get_device_capability(), liger=liger,
                  liger_types=liger_types,
                  flash_attn=importlib.util.find_spec("flash_attn") is not None,
                  bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None)


def planned_device(on_gpu: bool, bf16_card: bool, local: bool) -> Device:
    """The device a plan is for: the GPU table's card (bf16 cards are Ampere or newer), with this
    machine's packages when the run trains here, unknown packages when it trains elsewhere."""
    if not on_gpu:
        return Device(cuda=False)
    capability = (8, 0) if bf16_card else (7, 0)
    if not local:
        return Device(cuda=True, capability=capability, known=False)
    # Which model types Liger patches is read where it trains (importing it costs seconds).
    return Device(cuda=True, capability=capability,
                  liger=importlib.util.find_spec("liger_kernel") is not None,
                  flash_attn=importlib.util.find_spec("flash_attn") is not None,
                  bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None)


def for_run(spec: RunSpec, source: str, load_dtype: str, zero_stage: int = 0,
            offload_optimizer: bool = False, device: Device | None = None,
            optimizer: str = "adamw") -> FastPaths:
    """The fast paths of ``spec`` training here (``device``: this process's, unless given), for
    the model at ``source`` (its config's model type decides Liger)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, revision=spec.model.revision,
                                        trust_remote_code=spec.model.trust_remote_code)
    return resolve_fast_paths(spec.train.fast, device or local_device(),
                              getattr(config, "model_type", None), load_dtype,
                              stage=spec.method.stage, zero_stage=zero_stage,
                              offload_optimizer=offload_optimizer, optimizer=optimizer)
