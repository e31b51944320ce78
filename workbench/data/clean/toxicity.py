"""Offline toxicity filter: per-language word lists bundled with the package (en, zh).

English is matched word by word (so "Scunthorpe" does not match "cunt"); Chinese has no word
boundaries, so its terms are matched as substrings with one compiled alternation. The lists are
plain text files under ``workbench/data/clean/wordlists/``; a project can add terms or point to
its own folder of ``<lang>.txt`` files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from workbench.data.clean.step import Doc, Step, check
from workbench.data.clean.tokens import words
from workbench.errors import DatasetError

BUNDLED_WORDLISTS = Path(__file__).parent / "wordlists"


def load_wordlist(path: Path) -> list[str]:
    """Terms of a word-list file: one per line, lowercased, '#' comments and blanks skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read toxicity word list {path}: {e}; "
                           "check the toxicity step's wordlist_dir option") from e
    return [ln.strip().lower() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@dataclass
class ToxicityFilter(Step):
    """Remove documents containing at least ``min_hits`` terms from the word lists.

    Defaults: ``min_hits=1`` is C4's rule (Raffel et al. 2020 drop any page containing a word from
    the LDNOOBW list); FineWeb/datatrove keep C4's rule for English. Raise it to tolerate
    occasional profanity. ``languages``: which bundled lists to use (English words are checked
    in every document, since Chinese text often mixes in English). ``extra_words``: more terms
    (a term with a CJK character is matched as a substring). ``wordlist_dir``: a folder with
    ``en.txt`` / ``zh.txt`` to use instead of the bundled lists.
    """

    name: ClassVar[str] = "toxicity"

    min_hits: int = 1
    languages: list[str] = field(default_factory=lambda: ["en", "zh"])
    extra_words: list[str] = field(default_factory=list)
    wordlist_dir: str | None = None

    def __post_init__(self) -> None:
        check(self.min_hits >= 1, "min_hits must be >= 1")
        folder = Path(self.wordlist_dir) if self.wordlist_dir else BUNDLED_WORDLISTS
        terms: list[str] = [w.strip().lower() for w in self.extra_words if w.strip()]
        for lang in self.languages:
            path = folder / f"{lang}.txt"
            check(path.is_file(), f"no word list for language {lang!r} ({path} is missing); "
                  f"available: {sorted(p.stem for p in folder.glob('*.txt'))}")
            terms += load_wordlist(path)
        spaced = {t for t in terms if " " not in t and t.isascii()}
        self._words = frozenset(spaced)
        # Terms that are not single ASCII words (CJK terms, phrases) are matched as substrings.
        others = sorted({t for t in terms if t not in spaced}, key=len, reverse=True)
        self._substrings = re.compile("|".join(map(re.escape, others))) if others else None

    def hits(self, text: str, lower_words: list[str] | None = None) -> list[str]:
        """Word-list terms found in ``text`` (with repeats), e.g. ``['shit', '傻逼']``.

        ``lower_words``: ``words(text.lower())`` when the caller has it; used only for ASCII
        text, where lowercasing moves no word boundary, so it equals the words lowercased.
        """
        if lower_words is not None and text.isascii():
            found = [w for w in lower_words if w in self._words]
        else:
            ws = words(text)
            # Look each distinct word up once: most documents have no hit, and then that is all.
            hit = {w for w in set(ws) if w.lower() in self._words}
            found = [w.lower() for w in ws if w in hit] if hit else []
        if self._substrings is not None:
            found += self._substrings.findall(text.lower())
        return found

    def apply(self, doc: Doc) -> str | None:
        text = doc.text
        found = self.hits(text, doc.lower_words() if text.isascii() else None)
        if len(found) >= self.min_hits:
            doc.detail = f"{len(found)} word-list hit(s): {', '.join(sorted(set(found))[:5])}"
            return "wordlist"
        return None
