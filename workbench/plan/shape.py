"""Model shape: what the planner needs to know about a model, counted without downloading it.

:func:`model_shape` reads the model's config (a built-in, a local folder, the hub, or, offline, a
table of well-known configs) and counts parameters, linear layers and the largest module. Every
later estimate (memory, time, cost) starts from this. The decoder families whose layers are
known (:data:`COUNTED_TYPES`: llama, mistral, qwen2, qwen3) are counted from config.json's fields
by arithmetic, so planning a local or built-in model imports neither torch nor transformers (3-6 s
of a launch); anything else (remote code, another model_type, a config that leaves a shape field
to a library default) is instantiated on the meta device through transformers.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import ModelNotFoundError

# Offline defaults only: config fields (not parameter counts) of well-known models, copied from
# each model's config.json on the Hugging Face hub. Used when the hub is unreachable; the counts
# are still computed by instantiating these configs on the meta device.
OFFLINE_CONFIGS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "meta-llama/Llama-2-7b-hf": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, tie_word_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "meta-llama/Llama-3.1-70B": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True),
    # https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json
    "Qwen/Qwen2.5-1.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=131072, tie_word_embeddings=True),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "Qwen/Qwen2.5-7B": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistralai/Mistral-7B-v0.1": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, tie_word_embeddings=False),
}
# Same architecture under other names (instruct variants share the base's shape).
_OFFLINE_ALIASES = {
    "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-70B": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "meta-llama/Meta-Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-2-7b-chat-hf": "meta-llama/Llama-2-7b-hf",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistralai/Mistral-7B-v0.1",
}

# How each counted family builds its layers (transformers' modeling_*.py): which projections
# carry a bias (a config flag, or always), and per-head q/k norms. Shape fields a config.json
# leaves out are refused rather than guessed, since the library defaults differ by version.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True,
                  head_dim_required=True),
}
COUNTED_TYPES = frozenset(_FAMILIES)
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "intermediate_size")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, counted from its meta-device instance."""

    model_id: str
    params: int  # unique parameters (tied embeddings counted once)
    linear_weights: int  # every nn.Linear weight except lm_head: what 4/8-bit quantisation packs
    lm_head_weights: int  # matmul FLOPs of the output layer (also when tied to the embeddings)
    largest_layer_params: int  # biggest single module (ZeRO-3 gathers one at a time)
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) LoRA could target
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    source: str  # "config" or "offline table"
    # What "all-linear" adapts when it is not every linear: for a vision-language model the
    # language model's attention (workbench.train.vision.lora_targets), as a regex.
    all_linear: str | None = None

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        """Adapter parameters: r x (in + out) per targeted linear, matched like peft does (a
        string other than "all-linear" is a regex the whole module name must match)."""
        if targets == "all-linear" and self.all_linear is not None:
            targets = self.all_linear
        total = 0
        for name, fan_in, fan_out in self.linears:
            if targets == "all-linear" or (
                    re.fullmatch(targets, name) if isinstance(targets, str)
                    else any(name == t or name.endswith("." + t) for t in targets)):
                total += r * (fan_in + fan_out)
        return total


def _hub_reachable(timeout: float = 1.5) -> bool:
    # A failed AutoConfig download retries for ~30 s; a live plan in a form cannot wait that long.
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = host.partition(":")
    try:
        with socket.create_connection((host, int(port or 443)), timeout=timeout):
            return True
    except OSError:
        return False


def _config_on_target(model_id: str) -> tuple[Any, str] | None:
    """The config launch read on the run's target for a folder that exists only there
    (workbench.targets.remote_model), or None."""
    from workbench.targets.remote_model import target_config

    found = target_config(model_id)
    if found is None:
        return None
    from transformers import CONFIG_MAPPING

    model_type = str(found.config.get("model_type") or "")
    if model_type not in CONFIG_MAPPING:
        raise ModelNotFoundError(
            f"config.json of {found.path} on {found.where} names model_type {model_type!r}, "
            "which the transformers installed here does not know, so the run cannot be planned; "
            "upgrade transformers here, or copy the folder to this machine (custom model code "
            "is not read from the target)")
    return CONFIG_MAPPING[model_type].from_dict(found.config), f"config on {found.where}"


def _config_for(model_id: str, revision: str | None, trust_remote_code: bool) -> tuple[Any, str]:
    from transformers import AutoConfig

    from workbench.spec.models import load_config, resolve_model

    on_target = _config_on_target(model_id)
    if on_target is not None:
        return on_target
    offline_key = _OFFLINE_ALIASES.get(model_id, model_id)
    source = resolve_model(model_id)
    is_hub = source == model_id and not Path(os.path.expanduser(model_id)).exists()
    if is_hub and offline_key in OFFLINE_CONFIGS and not _hub_reachable():
        fields = dict(OFFLINE_CONFIGS[offline_key])
        return AutoConfig.for_model(fields.pop("model_type"), **fields), "offline table"
    try:
        return load_config(model_id, revision, trust_remote_code), "config"
    except ModelNotFoundError:
        if offline_key not in OFFLINE_CONFIGS:
            raise
        fields = dict(OFFLINE_CONFIGS[offline_key])
        return AutoConfig.for_model(fields.pop("model_type"), **fields), "offline table"


def local_config_fields(model_id: str, trust_remote_code: bool = False) -> dict[str, Any] | None:
    """The parsed config.json of a built-in or local model of a counted family; None for a hub
    id, remote code, another model_type or an unreadable file (those go through transformers)."""
    from workbench.spec.models import resolve_model

    if trust_remote_code:
        return None
    source = resolve_model(model_id)  # raises ModelNotFoundError for what is nowhere
    if source == model_id and not Path(os.path.expanduser(model_id)).exists():
        return None  # a hub id
    try:
        fields = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or fields.get("model_type") not in COUNTED_TYPES \
            or "auto_map" in fields:
        return None
    return fields


def _offline_fields(model_id: str) -> dict[str, Any] | None:
    key = _OFFLINE_ALIASES.get(model_id, model_id)
    return dict(OFFLINE_CONFIGS[key]) if key in OFFLINE_CONFIGS else None


def counted_shape(model_id: str, fields: dict[str, Any], source: str) -> ModelShape | None:
    """The shape of a counted family from its config fields, by arithmetic over the layers
    transformers builds (None when the family is not counted or a shape field is missing)."""
    family = _FAMILIES.get(str(fields.get("model_type")))
    if family is None or any(not isinstance(fields.get(k), int) for k in _REQUIRED):
        return None
    hidden, layers, heads = (fields["hidden_size"], fields["num_hidden_layers"],
                             fields["num_attention_heads"])
    vocab, inter = fields["vocab_size"], fields["intermediate_size"]
    if "num_key_value_heads" not in fields or (
            family.get("head_dim_required") and not fields.get("head_dim")):
        return None
    kv_heads = fields["num_key_value_heads"] or heads
    head_dim = fields.get("head_dim") or hidden // heads

    def flag(name: str) -> bool:
        rule = family.get(name, False)
        return bool(fields.get(rule, False)) if isinstance(rule, str) else bool(rule)

    qkv_bias, o_bias, mlp_bias = flag("qkv_bias"), flag("o_bias"), flag("mlp_bias")
    per_layer = [  # (name, in, out, bias)
        ("self_attn.q_proj", hidden, heads * head_dim, qkv_bias),
        ("self_attn.k_proj", hidden, kv_heads * head_dim, qkv_bias),
        ("self_attn.v_proj", hidden, kv_heads * head_dim, qkv_bias),
        ("self_attn.o_proj", heads * head_dim, hidden, o_bias),
        ("mlp.gate_proj", hidden, inter, mlp_bias),
        ("mlp.up_proj", hidden, inter, mlp_bias),
        ("mlp.down_proj", inter, hidden, mlp_bias),
    ]
    layer_linear = sum(i * o + (o if b else 0) for _, i, o, b in per_layer)
    layer_norms = 2 * hidden + (2 * head_dim if family.get("qk_norm") else 0)
    embed = vocab * hidden
    tied = bool(fields.get("tie_word_embeddings", False))
    return ModelShape(
        model_id=model_id,
        params=embed + layers * (layer_linear + layer_norms) + hidden + (0 if tied else embed),
        linear_weights=layers * sum(i * o for _, i, o, _ in per_layer),
        lm_head_weights=embed,
        # One module's own parameters: the embedding (and the head, tied or not) or one linear.
        largest_layer_params=max(embed, *(i * o + (o if b else 0) for _, i, o, b in per_layer)),
        linears=tuple((f"model.layers.{n}.{name}", i, o)
                      for n in range(layers) for name, i, o, _ in per_layer),
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=inter,
        vocab=vocab, source=source,
    )


@functools.lru_cache(maxsize=32)
def model_shape(model_id: str, revision: str | None = None,
                trust_remote_code: bool = False) -> ModelShape:
    """Count parameters and LoRA-able layers of ``model_id`` without downloading weights."""
    from workbench.targets.remote_model import target_config

    found = target_config(model_id)
    if found is not None:  # a folder only the run's target has: counted from the config read there
        theirs = found.config
        if not trust_remote_code and theirs.get("model_type") in COUNTED_TYPES \
                and "auto_map" not in theirs:
            counted = counted_shape(model_id, dict(theirs), f"config on {found.where}")
            if counted is not None:
                return counted
        return meta_shape(model_id, revision, trust_remote_code)
    fields = local_config_fields(model_id, trust_remote_code)
    if fields is not None:
        counted = counted_shape(model_id, fields, "config")
        if counted is not None:
            return counted
    elif not trust_remote_code and (offline := _offline_fields(model_id)) is not None \
            and not _hub_reachable():
        counted = counted_shape(model_id, offline, "offline table")
        if counted is not None:
            return counted
    return meta_shape(model_id, revision, trust_remote_code)


def meta_shape(model_id: str, revision: str | None = None,
               trust_remote_code: bool = False) -> ModelShape:
    """The shape counted on a meta-device instance of the model (imports torch + transformers):
    for what :func:`counted_shape` does not know, and the reference it is tested against."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from workbench.assets.tiny_vlm import LANGUAGE_ATTENTION

    cfg, source = _config_for(model_id, revision, trust_remote_code)
    # A vision-language model counts its vision tower too (its weights are loaded and held).
    vision = getattr(cfg, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg, trust_remote_code=trust_remote_code)
    out_emb = model.get_output_embeddings()
    linears: list[tuple[str, int, int]] = []
    linear_weights = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not out_emb:
            # peft's "all-linear" also skips the output layer.
            linears.append((name, module.in_features, module.out_features))
            linear_weights += module.weight.numel()
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(getattr(text_cfg, "num_attention_heads", 1))
    hidden = int(getattr(text_cfg, "hidden_size", 0))
    return ModelShape(
        model_id=model_id,
        params=sum(p.numel() for p in model.parameters()),
        linear_weights=linear_weights,
        lm_head_weights=out_emb.weight.numel() if out_emb is not None else 0,
        largest_layer_params=largest,
        linears=tuple(linears),
        hidden=hidden,
        layers=int(getattr(text_cfg, "num_hidden_layers", 1)),
        heads=heads,
        kv_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        intermediate=int(getattr(text_cfg, "intermediate_size", 4 * hidden)),
        vocab=int(getattr(text_cfg, "vocab_size", 0)),
        source=source,
        all_linear=LANGUAGE_ATTENTION if vision else None,
    )
