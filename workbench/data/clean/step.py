"""The step protocol every cleaning step follows, and the document a step works on.

A step is a small dataclass whose fields are its parameters (so ``CleanSpec.options`` maps onto
them one to one). Per-document steps implement :meth:`Step.apply`, which either returns ``None``
(keep, possibly after rewriting ``doc.texts``) or a short reason code (remove). Dedup steps are
split in two: :meth:`DedupStep.key` runs next to the other per-document work in a worker process,
and the :class:`DedupIndex` that decides "seen before?" lives in the parent process, so duplicates
are found across all workers and the first occurrence in input order is always the one kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from workbench.data.clean.tokens import guess_script_language, words


@dataclass
class Doc:
    """One record's text fields as they stand after the steps run so far.

    ``texts`` maps field name to text; filters look at :attr:`text`, the fields joined by a blank
    line. ``lang`` is set by the langid step (or guessed from the script when a later step needs
    it). ``detail`` is a human-readable note on why the doc was removed, shown in report examples.
    """

    texts: dict[str, str]
    lang: str | None = None
    lang_score: float = 0.0
    detail: str = ""
    counters: dict[str, int] = field(default_factory=dict)
    _text: str | None = None
    _lower_words: list[str] | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "\n\n".join(self.texts.values())
        return self._text

    def set_texts(self, texts: dict[str, str]) -> None:
        self.texts = texts
        self._text = None
        self._lower_words = None

    def lower_words(self) -> list[str]:
        """``words(text.lower())``, computed once per text and shared by the steps that need it
        (quality, and toxicity on ASCII text). Callers must not modify the list."""
        if self._lower_words is None:
            self._lower_words = words(self.text.lower())
        return self._lower_words

    def language(self) -> str:
        """Detected language, or a script-based guess ('zh' / 'en') when no langid step ran."""
        if self.lang is None:
            self.lang = guess_script_language(self.text)
        return self.lang


class Step:
    """Base of every step: ``name`` is what RunSpec and the CLI call it."""

    name: ClassVar[str] = ""
    #: True for steps that may rewrite text (counted as "modified" in the report).
    rewrites: ClassVar[bool] = False

    def apply(self, doc: Doc) -> str | None:  # pragma: no cover - every step overrides
        """Return None to keep ``doc`` (possibly rewritten), or a reason code to remove it."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The step's parameters as JSON-friendly values, for the report."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if not f.name.startswith("_")
        }


class DedupIndex:
    """Parent-process state of a dedup step: ``seen(key)`` says whether a key was seen before
    and remembers it when it was not."""

    def seen(self, key: Any) -> bool:  # pragma: no cover - subclasses override
        raise NotImplementedError


class DedupStep(Step):
    """A step whose decision depends on earlier documents (see the module docstring)."""

    def apply(self, doc: Doc) -> str | None:
        return None  # the decision is made by the index, in input order

    def key(self, doc: Doc) -> Any:  # pragma: no cover - subclasses override
        raise NotImplementedError

    def new_index(self) -> DedupIndex:  # pragma: no cover - subclasses override
        raise NotImplementedError


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``: steps' parameter validation.

    The pipeline turns these into SpecError entries naming ``data.clean.options.<step>``.
    """
    if not condition:
        raise ValueError(message)
