"""The built-in tiny model: a 2-layer Llama with a byte-level BPE tokenizer trained locally.

Built once into WORKBENCH_HOME/assets (a second or two), deterministically from a fixed seed, and
saved with ``save_pretrained`` so every code path (training, merging, vLLM) treats it like any
model folder. head_dim is 32 because vLLM's CPU attention serves no smaller head size.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

TINY_LLAMA_CONFIG: dict = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    # Wider than the usual 0.02: with a frozen random lm_head, 0.02 caps the logits so low that
    # LoRA cannot make any answer confident (the loss stalls near 5 nats).
    "initializer_range": 0.1,
}

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# One turn per role; the assistant turn ends with <|end|>, which is also the EOS token, so
# generation stops where the training targets stopped.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_VERSION = "2"  # bump when the recipe changes, so stale cached builds are rebuilt


def builtin_model_path(name: str = "builtin:tiny-llama") -> Path:
    if name != "builtin:tiny-llama":
        from workbench.errors import ModelNotFoundError

        raise ModelNotFoundError(
            f"unknown built-in model {name!r}; the built-in is 'builtin:tiny-llama'"
        )
    return built_once("tiny-llama", _VERSION, build_tiny_model)


def built_once(name: str, version: str, build: Callable[[Path], None]) -> Path:
    """WORKBENCH_HOME/assets/NAME, written by ``build`` into a folder of its own the first time
    (or when ``version`` changed), then renamed into place."""
    from workbench.runs.home import assets_dir

    path = assets_dir() / name
    if (path / f".built-v{version}").is_file():
        return path
    tmp = path.with_name(f"{name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / f".built-v{version}").write_text("ok\n")
    # Another process may have built it meanwhile; either copy is identical (fixed seed).
    if path.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _corpus() -> list[str]:
    from workbench.assets.teaching import teaching_rows

    texts = []
    for split in ("train", "heldout"):
        for row in teaching_rows(split):
            texts += [row["instruction"], row["output"]]
    # A little general English so user data does not fall back to single bytes everywhere.
    texts.append(
        "The quick brown fox jumps over the lazy dog. Please answer the question below in one "
        "word. You are a helpful assistant. Write a short summary of the following text. "
        "Translate the sentence into French. What is the answer? Explain why."
    )
    return texts


def build_tiny_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from workbench.train.quiet import no_progress_bars

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_LLAMA_CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=TINY_LLAMA_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        **{**TINY_LLAMA_CONFIG, "vocab_size": len(fast)},
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    with no_progress_bars():  # built once, in a second: no bar above the notebook's widgets
        model.save_pretrained(out)
