"""Tokenised rows into training batches: padding-free packing and the padding collator.

Labels of ``IGNORE`` (-100) count in no loss: padding, prompts, and a packed example's first token.

    >>> Collator(pad_token_id=0)([{"input_ids": [5, 6], "labels": [-100, 6]}])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

IGNORE = -100


def pack(examples: Iterable[dict[str, list[int]]], block: int) -> list[dict[str, list[int]]]:
    """Padding-free packing: whole examples, in order, into rows of at most ``block`` tokens.

    Each row carries ``position_ids`` that restart at 0 where an example starts: attention uses
    them as example boundaries (transformers builds a block-diagonal causal mask from them for
    SDPA/eager, and varlen kernels for flash attention), so no example attends to another, as
    with TRL's padding-free packing. An example's first token is never a label (it would be
    predicted from the previous example's last token).
    """
    out: list[dict[str, list[int]]] = []
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        n = len(ex["input_ids"])
        if row["input_ids"] and len(row["input_ids"]) + n > block:
            out.append(row)
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += ex["input_ids"]
        row["labels"] += [IGNORE] + list(ex["labels"][1:])
        row["position_ids"] += range(n)
    if row["input_ids"]:
        out.append(row)
    return out


class Collator:
    """Right-pads a batch; labels are padded with -100 so padding never counts in the loss.

    Packed rows (with ``position_ids``, see :func:`pack`) are instead laid end to end in one
    row without padding or attention mask, as transformers' ``DataCollatorWithFlattening`` does,
    keeping each example's own positions so attention stays inside it.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        if "position_ids" in batch[0]:
            flat: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
            for b in batch:
                flat["input_ids"] += b["input_ids"]
                flat["labels"] += [IGNORE] + list(b["labels"][1:])
                flat["position_ids"] += b["position_ids"]
            return {k: torch.tensor([v], dtype=torch.long) for k, v in flat.items()}
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
