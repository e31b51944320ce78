"""Normalisation: Unicode form, invisible characters and whitespace, before anything is compared.

Runs first so that exact dedup, MinHash and the heuristics see one spelling of each text:
``"café"`` written with a combining accent and ``"café"`` precomposed hash the same, and two
copies that differ only by trailing spaces or ``\\r\\n`` line ends count as exact duplicates.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import ClassVar

from workbench.data.clean.step import Doc, Step, check

# C0/C1 control characters except tab and newline, plus zero-width and BOM characters that
# scraped text carries invisibly (U+200B..U+200D, U+2060, U+FEFF).
_INVISIBLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]")
# Horizontal whitespace, including the ideographic space U+3000 common in Chinese text.
_SPACES = re.compile("[ \t\u00a0\u3000\u2000-\u200a\u202f\u205f]+")
# The same class without the plain space: a text with none of these and no two spaces in a row
# has nothing for _SPACES to change (a lone " " becomes " "), so the slow substitution is skipped.
_ODD_SPACE = re.compile("[\t\u00a0\u3000\u2000-\u200a\u202f\u205f]")
_TRAILING = re.compile(" +\n")


@dataclass
class Normalize(Step):
    """Unicode normalisation and whitespace clean-up (rewrites text, never removes).

    Defaults and where they come from:

    - ``form="NFC"``: the W3C character model's recommended form. It composes accents without
      touching full-width CJK punctuation; ``"NFKC"`` would also turn ``，`` into ``,`` (CCNet
      applies NFKC-like folding only to its dedup keys, not to the text it keeps).
    - ``collapse_spaces=True``: runs of spaces/tabs become one space, as in C4 and datatrove's
      text normaliser; line breaks are kept because Gopher/C4/FineWeb rules are line-based.
    - ``max_blank_lines=1``: three or more newlines become two (one blank line).
    """

    name: ClassVar[str] = "normalize"
    rewrites: ClassVar[bool] = True

    form: str = "NFC"
    collapse_spaces: bool = True
    max_blank_lines: int = 1

    def __post_init__(self) -> None:
        check(self.form in ("NFC", "NFKC", "NFD", "NFKD", "none"),
              f"form must be NFC, NFKC, NFD, NFKD or none (got {self.form!r})")
        check(self.max_blank_lines >= 0, "max_blank_lines must be >= 0")
        self._blank = "\n" * (self.max_blank_lines + 1)
        self._too_many = re.compile(f"\n{{{self.max_blank_lines + 2},}}")
        self._too_many_str = "\n" * (self.max_blank_lines + 2)

    def normalize(self, text: str) -> str:
        if self.form != "none" and not (text.isascii() and self.form in ("NFC", "NFD")):
            text = unicodedata.normalize(self.form, text)  # type: ignore[arg-type]  # checked above
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        text = _INVISIBLE.sub("", text)
        # Each substitution runs only when its pattern can match (same result, much faster).
        if self.collapse_spaces:
            if "  " in text or _ODD_SPACE.search(text):
                text = _SPACES.sub(" ", text)
            if " \n" in text:
                text = _TRAILING.sub("\n", text)
        if self._too_many_str in text:
            text = self._too_many.sub(self._blank, text)
        return text.strip()

    def apply(self, doc: Doc) -> str | None:
        new = {k: self.normalize(v) for k, v in doc.texts.items()}
        if new != doc.texts:
            doc.set_texts(new)
        return None
