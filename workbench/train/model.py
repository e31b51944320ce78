"""The model a rank trains: the base weights in the dtypes :mod:`workbench.spec.precision` chose,
with the attention kernel :mod:`workbench.train.fastpath` chose, quantised for QLoRA and wrapped
with peft's LoRA adapters for LoRA and QLoRA.
"""

from __future__ import annotations

import os
from typing import Any

from workbench.spec import RunSpec
from workbench.spec.precision import Precision, local_device_kind, resolve_precision
from workbench.train.fastpath import FastPaths, for_run


def load_model(spec: RunSpec, source: str, precision: Precision | None = None,
               fast: FastPaths | None = None) -> Any:
    """The model (peft-wrapped for LoRA/QLoRA) in the dtypes :mod:`workbench.spec.precision` chose
    for this device, with the attention kernel :mod:`workbench.train.fastpath` chose
    (``precision`` / ``fast`` override the choices, e.g. to check a GPU's choice on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = precision or resolve_precision(spec.model.dtype, spec.method.kind, local_device_kind())
    print(f"precision: load {p.load_dtype}, amp {p.amp}: {p.reason}", flush=True)
    fast = fast or for_run(spec, source, p.load_dtype)
    kwargs: dict[str, Any] = {"revision": spec.model.revision,
                              "trust_remote_code": spec.model.trust_remote_code,
                              **fast.model_kwargs()}
    dtype = getattr(torch, p.load_dtype)
    kwargs["dtype"] = dtype
    if spec.model.quantization != "none":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=spec.model.quantization == "4bit",
            load_in_8bit=spec.model.quantization == "8bit",
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, p.compute_dtype),
        )
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    model: Any = AutoModelForCausalLM.from_pretrained(source, **kwargs)  # or its peft wrapper
    _log_partitioning(model)
    if spec.method.kind in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if spec.method.kind == "qlora":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=spec.train.gradient_checkpointing)
        lora = LoraConfig(
            r=spec.method.lora_r,
            lora_alpha=spec.method.lora_alpha,
            lora_dropout=spec.method.lora_dropout,
            target_modules=spec.method.target_modules,
            task_type="CAUSAL_LM",
        )
        # peft keeps the adapters fp32 over a 16-bit base (autocast_adapter_dtype), so they and
        # their Adam state never lose small updates.
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    return model


def _log_partitioning(model: Any) -> None:
    """Under ZeRO-3, say how much of the model this rank holds right after loading."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    params = list(model.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    print(f"zero3: loaded partitioned: this rank holds {local} of {total} parameter elements",
          flush=True)
