"""The built-in tiny vision-language model: a random-weight Qwen2-VL a LoRA step trains in milliseconds.

A real architecture (``Qwen2VLForConditionalGeneration``: a ViT with 2x2 patch merging in front
of a Qwen2 decoder with multimodal rotary positions), so every path a user's Qwen2-VL takes
(processor, LoRA on the decoder, merging, serving with vLLM, which supports LoRA on this class)
is the one the built-in takes. Built once into WORKBENCH_HOME/assets, deterministically (fixed
seed), from the tiny text model's locally trained tokenizer plus Qwen2-VL's four vision tokens.
The image processor keeps at most 84x84 pixels, so an image is nine tokens. Head sizes are 32,
the smallest vLLM's CPU attention serves.

    >>> path = builtin_vlm_path()                     # doctest: +SKIP
    >>> from workbench.data.images import load_processor
    >>> processor = load_processor(path)              # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.assets.tiny_model import TINY_LLAMA_CONFIG

BUILTIN_VLM = "builtin:tiny-qwen2-vl"

# The four tokens Qwen2-VL's processor and model look for, under their usual names.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

PATCH_SIZE = 14
MERGE_SIZE = 2  # 2x2 patches become one token
MIN_PIXELS = 28 * 28  # one token
MAX_PIXELS = 84 * 84  # nine tokens: the teaching images' size

# The tiny text model's decoder (its shape and its wide initialisation: a frozen random lm_head
# needs wide logits for LoRA to learn), as Qwen2-VL's language model.
TINY_TEXT_CONFIG: dict[str, Any] = {
    **{k: TINY_LLAMA_CONFIG[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "initializer_range")},
    # The rotary half (head_dim 32 / 2) split between time, height and width positions.
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
}

TINY_VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "mlp_ratio": 2,
    "hidden_size": TINY_TEXT_CONFIG["hidden_size"],  # the merger projects into the decoder
    "patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": 2,
}

# The tiny text model's turns, where a turn's content may be a list of text and image parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# The decoder's attention projections, not the vision tower's (whose attention is one fused qkv).
LANGUAGE_ATTENTION = r".*language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"

_VERSION = "1"  # bump when the recipe changes, so stale cached builds are rebuilt


def builtin_vlm_path(name: str = BUILTIN_VLM) -> Path:
    """The built-in VLM's folder, built on first use (a few seconds)."""
    if name != BUILTIN_VLM:
        from workbench.errors import ModelNotFoundError

        raise ModelNotFoundError(
            f"unknown built-in vision-language model {name!r}; the built-in is {BUILTIN_VLM!r}")
    from workbench.assets.tiny_model import built_once

    return built_once("tiny-qwen2-vl", _VERSION, build_tiny_vlm)


def build_tiny_vlm(out: Path) -> None:
    """Write the tiny Qwen2-VL (weights, config, tokenizer, image processor) into ``out``."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from workbench.assets.tiny_model import builtin_model_path
    from workbench.train.quiet import no_progress_bars

    out.mkdir(parents=True, exist_ok=True)
    # The text model's tokenizer (trained locally, deterministic), plus the vision tokens.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(builtin_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # The PIL image processor needs no torchvision; it saves as the default Qwen2VLImageProcessor.
    images = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
        temporal_patch_size=TINY_VISION_CONFIG["temporal_patch_size"], merge_size=MERGE_SIZE)
    images.save_pretrained(out)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config={**TINY_TEXT_CONFIG, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config=dict(TINY_VISION_CONFIG),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    with no_progress_bars():
        model.save_pretrained(out)
