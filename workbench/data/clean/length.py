"""Length filter: drop texts that are empty, fragments, or pathologically long.

Measured in characters of the joined text fields (after normalisation), so the rule means the
same for Chinese and English; word-count rules (Gopher's 50..100,000 words) live in the quality
step, where they are language-aware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from workbench.data.clean.step import Doc, Step, check


@dataclass
class LengthFilter(Step):
    """Keep documents with ``min_chars <= len(text) <= max_chars``.

    Defaults: ``min_chars=20`` drops empty rows and fragments too short to teach anything (this
    project's choice; C4 similarly drops pages with fewer than 3 sentences / 5 words per line);
    ``max_chars=1_000_000`` is a guard against runaway pages well above Gopher's 100,000-word
    ceiling. For short instruction data lower ``min_chars`` (e.g. ``{"length": {"min_chars": 1}}``).
    """

    name: ClassVar[str] = "length"

    min_chars: int = 20
    max_chars: int = 1_000_000

    def __post_init__(self) -> None:
        check(self.min_chars >= 0, "min_chars must be >= 0")
        check(self.max_chars >= self.min_chars, "max_chars must be >= min_chars")

    def apply(self, doc: Doc) -> str | None:
        n = len(doc.text)
        if n < self.min_chars:
            doc.detail = f"{n} chars < min_chars={self.min_chars}"
            return "too_short"
        if n > self.max_chars:
            doc.detail = f"{n} chars > max_chars={self.max_chars}"
            return "too_long"
        return None
