"""Token statistics of a run's data: lengths, truncation, losses, and tokens trained per epoch.

Collected while tokenising (:mod:`workbench.data.tokenized`), written to ``RUN_DIR/data/stats.json``
and shown by the planner and the run form. Lengths are counted *before* truncation, so they say how
far the data is from ``max_length``; ``trainable_tokens`` counts the response tokens that are
actually trained on after it.

    >>> stats.splits["train"].tokens  # doctest: +SKIP
    {'min': 21, 'median': 24, 'p95': 30, 'max': 33}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.data.tokenize import Encoded


def _summary(values: list[int]) -> dict[str, int | None]:
    if not values:
        return {"min": None, "median": None, "p95": None, "max": None}
    v = sorted(values)
    # Nearest-rank percentiles: every figure is a length some example really has.
    return {"min": v[0], "median": v[(len(v) - 1) // 2],
            "p95": v[min(len(v) - 1, -(-95 * len(v) // 100) - 1)], "max": v[-1]}


@dataclass
class SplitStats:
    examples: int = 0
    truncated: int = 0  # longer than max_length, shortened but still trained
    dropped: int = 0  # no trained token left after truncation (never trained on)
    trainable_tokens: int = 0
    cut_tokens: int = 0  # tokens truncation removed from the truncated examples
    truncated_tokens: int = 0  # those examples' tokens before truncation
    tokens: dict[str, Any] = field(default_factory=dict)  # min/median/p95/max before truncation
    prompt_tokens: dict[str, Any] = field(default_factory=dict)
    response_tokens: dict[str, Any] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # every example's length (for histograms)
    saved_histogram: dict[str, list[int]] | None = field(default=None, repr=False)  # from JSON
    _prompt: list[int] = field(default_factory=list, repr=False)
    _response: list[int] = field(default_factory=list, repr=False)

    @property
    def kept(self) -> int:
        return self.examples - self.dropped

    def add(self, enc: Encoded) -> int:
        """Count one example; returns its trained tokens (0: dropped)."""
        trainable = enc.trainable
        self.examples += 1
        self.truncated += enc.truncated and trainable > 0
        if enc.truncated:
            before = enc.prompt_tokens + enc.response_tokens
            self.truncated_tokens += before
            self.cut_tokens += max(0, before - len(enc.input_ids))
        self.dropped += trainable == 0
        self.trainable_tokens += trainable
        self.lengths.append(enc.prompt_tokens + enc.response_tokens)
        self._prompt.append(enc.prompt_tokens)
        self._response.append(enc.response_tokens)
        self.tokens = self.prompt_tokens = self.response_tokens = {}  # summarised on demand
        return trainable

    def summarised(self) -> SplitStats:
        if not self.tokens:
            self.tokens = _summary(self.lengths)
            self.prompt_tokens = _summary(self._prompt)
            self.response_tokens = _summary(self._response)
        return self

    def histogram(self, max_length: int, bins: int = 24) -> dict[str, list[int]]:
        """Counts of example lengths in equal bins from 0 to the longest (or max_length)."""
        if not self.lengths and self.saved_histogram:
            return self.saved_histogram
        top = max([max_length, *self.lengths])
        width = max(1, -(-top // bins))
        counts = [0] * bins
        for n in self.lengths:
            counts[min(bins - 1, n // width)] += 1
        return {"edges": [i * width for i in range(bins + 1)], "counts": counts}

    def to_dict(self, max_length: int) -> dict[str, Any]:
        self.summarised()
        return {"examples": self.examples, "kept": self.kept, "truncated": self.truncated,
                "dropped": self.dropped, "trainable_tokens": self.trainable_tokens,
                "cut_tokens": self.cut_tokens, "truncated_tokens": self.truncated_tokens,
                "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "response_tokens": self.response_tokens,
                "histogram": self.histogram(max_length)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitStats:
        return cls(examples=d["examples"], truncated=d["truncated"], dropped=d["dropped"],
                   trainable_tokens=d["trainable_tokens"], cut_tokens=d.get("cut_tokens", 0),
                   truncated_tokens=d.get("truncated_tokens", 0), tokens=d["tokens"],
                   prompt_tokens=d["prompt_tokens"], response_tokens=d["response_tokens"],
                   saved_histogram=d.get("histogram"))


@dataclass
class TokenStats:
    """Per split statistics plus the settings they were measured under."""

    splits: dict[str, SplitStats]
    max_length: int
    truncation: str
    packing: bool
    fingerprint: str | None = None

    @property
    def trainable_tokens_per_epoch(self) -> int:
        """Tokens the loss is computed on in one pass over the training split."""
        return self.splits["train"].trainable_tokens

    def histogram(self, split: str = "train") -> dict[str, list[int]]:
        return self.splits[split].histogram(self.max_length)

    def to_dict(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "truncation": self.truncation,
                "packing": self.packing, "fingerprint": self.fingerprint,
                "trainable_tokens_per_epoch": self.trainable_tokens_per_epoch,
                "splits": {k: v.to_dict(self.max_length) for k, v in self.splits.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenStats:
        return cls(splits={k: SplitStats.from_dict(v) for k, v in d["splits"].items()},
                   max_length=d["max_length"], truncation=d["truncation"],
                   packing=d["packing"], fingerprint=d.get("fingerprint"))

    def summary(self) -> str:
        """A few lines for the plan and the form, e.g. 'train: 211 examples, 3 truncated, ...'."""
        lines = []
        for name, s in self.splits.items():
            if not s.examples:
                continue
            s.summarised()
            t = s.tokens
            lines.append(
                f"{name}: {s.examples:,} examples, tokens min/median/p95/max "
                f"{t['min']}/{t['median']}/{t['p95']}/{t['max']} (max_length {self.max_length}); "
                f"{s.truncated:,} truncated, {s.dropped:,} dropped; "
                f"{s.trainable_tokens:,} trained tokens")
        return "\n".join(lines)
