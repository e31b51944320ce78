"""Where an assistant turn's characters land in its tokens: a text's encoding with the character
lookups of the Rust tokenizer (:class:`Tokens`, or a slow tokenizer's offsets) and the labels of
an encoded chat, trained on the tokens of its assistant spans only (:func:`span_labels`).

Spans are found on the rendered text by :class:`workbench.data.tokenize.ChatRenderer`; mapping
them through offsets works for any chat template without knowing its markers.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

from workbench.data.batches import IGNORE


class Tokens:
    """One encoded text: ids, and where a character lands (the Rust encoding's own lookups)."""

    __slots__ = ("ids", "_enc", "_offsets", "_starts", "_ends", "_chars")

    def __init__(self, ids: list[int], chars: int, enc: Any = None,
                 offsets: Sequence[Sequence[int]] | None = None) -> None:
        self.ids, self._chars, self._enc, self._offsets = ids, chars, enc, offsets
        if offsets is not None:
            self._starts = [a for a, _ in offsets]
            self._ends = [b for _, b in offsets]

    def chars(self, k: int) -> tuple[int, int]:
        if self._enc is not None:
            span = self._enc.token_to_chars(k)
            return (span[0], span[1]) if span else (0, 0)
        a, b = self._offsets[k]  # type: ignore[index]
        return a, b

    def covering(self, i: int, j: int) -> list[int]:
        """The tokens in ``range(i, j)`` that cover at least one character."""
        if self._enc is None:
            return [k for k in range(i, j) if self._ends[k] > self._starts[k]]
        # The Rust lookup called directly: a Python method call per token would be a large share
        # of the cost of tokenising.
        to_chars = self._enc.token_to_chars
        return [k for k in range(i, j) if (span := to_chars(k)) and span[1] > span[0]]

    def first_after(self, pos: int) -> int:
        """Index of the first token that ends after ``pos`` (len(ids) if none)."""
        if self._enc is None:
            return bisect_right(self._ends, pos)
        # Materialising every offset costs more than the whole encode on short rows: look up
        # characters instead, skipping those no token covers (a trimmed space).
        while pos < self._chars:
            k = self._enc.char_to_token(pos)
            if k is not None:
                return k
            pos += 1
        return len(self.ids)

    def first_from(self, pos: int) -> int:
        """Index of the first token that starts at or after ``pos``."""
        if self._enc is None:
            return bisect_left(self._starts, pos)
        k = self.first_after(pos)
        while k < len(self.ids) and self.chars(k)[0] < pos:
            k += 1
        return k


def encode_texts(tokenizer: Any, texts: list[str], special: bool) -> list[Tokens]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: transformers' wrapping costs as much
        return [Tokens(e.ids, len(t), enc=e)
                for t, e in zip(texts, backend.encode_batch(texts, add_special_tokens=special))]
    enc = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=True)
    return [Tokens(list(i), len(t), offsets=o)
            for t, i, o in zip(texts, enc["input_ids"], enc["offset_mapping"])]


def span_labels(ids: list[int], tokens: Tokens, text: str,
            spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """The labels of an encoded chat, and the index of its first trained token."""
    labels = [IGNORE] * len(ids)
    first = len(ids)
    for s, e in spans:
        # From the first token that ends inside the span: a byte-level BPE merges the space a
        # template puts before the answer into the answer's first token, which must be trained.
        i, j = tokens.first_after(s), tokens.first_from(e)
        # The newline a template puts after the end-of-turn token is formatting, not an answer.
        while j > i:
            a, b = tokens.chars(j - 1)
            if text[a:b].strip():
                break
            j -= 1
        trained = tokens.covering(i, j)
        for k in trained:
            labels[k] = ids[k]
        if trained and trained[0] < first:
            first = trained[0]
    return labels, first
