"""Tokenise prepared examples for causal-LM training: chat template, loss on responses only, packing.

Labels are -100 everywhere except on the assistant turns (including the end-of-turn token, so the
model learns to stop). Spans are found on the rendered text and mapped to tokens through the fast
tokenizer's offsets, which works for any chat template without knowing its markers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

IGNORE = -100

# Used when a base model's tokenizer has no chat template of its own; saved with the artefacts so
# serving renders prompts exactly as training did.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '### ' + m['role'] + ':\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def _render(tokenizer: Any, messages: list[dict[str, str]], **kw: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def tokenize_example(example: dict[str, Any], tokenizer: Any, max_length: int) -> dict[str, list[int]]:
    if "text" in example:
        enc = tokenizer(example["text"] + tokenizer.eos_token, add_special_tokens=True,
                        truncation=True, max_length=max_length)
        ids = list(enc["input_ids"])
        return {"input_ids": ids, "labels": list(ids)}
    messages = example["messages"]
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True))
        end = len(_render(tokenizer, messages[: i + 1]))
        spans.append((start, end))
    # The template already carries BOS where the model wants it.
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True,
                    truncation=True, max_length=max_length)
    ids = list(enc["input_ids"])
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"]):
        inside = any(s <= a < e and b > a for s, e in spans)
        labels.append(tok if inside and not _is_trailing_space(full, a, b) else IGNORE)
    return {"input_ids": ids, "labels": labels}


def _is_trailing_space(text: str, a: int, b: int) -> bool:
    # The newline a template puts after the end-of-turn token is formatting, not an answer.
    return text[a:b].strip() == ""


def pack(examples: Iterable[dict[str, list[int]]], block: int) -> list[dict[str, list[int]]]:
    """Concatenate tokenised examples into blocks of ``block`` tokens (the last one may be short)."""
    out, ids, labels = [], [], []
    for ex in examples:
        ids += ex["input_ids"]
        labels += ex["labels"]
        while len(ids) >= block:
            out.append({"input_ids": ids[:block], "labels": labels[:block]})
            ids, labels = ids[block:], labels[block:]
    if ids:
        out.append({"input_ids": ids, "labels": labels})
    return out


class Collator:
    """Right-pads a batch; labels are padded with -100 so padding never counts in the loss."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), self.pad, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            k = len(b["input_ids"])
            ids[i, :k] = torch.tensor(b["input_ids"])
            labels[i, :k] = torch.tensor(b["labels"])
            mask[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
