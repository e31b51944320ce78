"""CJK-aware word segmentation shared by the quality, toxicity and near-duplicate steps.

Chinese (and Japanese/Korean) text has no spaces, so a "word" is a single CJK character there and
a run of letters/digits elsewhere. Counting this way makes word-based rules (Gopher's word counts,
MinHash word shingles) behave sensibly on mixed zh/en text without a segmentation model.
"""

from __future__ import annotations

import re

# Ranges: CJK Unified Ideographs + Ext. A, compatibility ideographs, kana, Hangul syllables.
CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CJK_CHAR = re.compile(f"[{CJK_RANGES}]")
# One CJK character, or a run of word characters that are not CJK.
WORD_RE = re.compile(f"[{CJK_RANGES}]|[^\\W{CJK_RANGES}]+")


def words(text: str) -> list[str]:
    """Words of ``text``: one per CJK character, one per run of other letters/digits.

    >>> words("Hello, 世界 42!")
    ['Hello', '世', '界', '42']
    """
    return WORD_RE.findall(text)


def cjk_fraction(text: str, sample: int = 2000) -> float:
    """Share of CJK characters among the non-space characters of the first ``sample`` chars."""
    head = text[:sample]
    letters = len("".join(head.split()))
    if letters == 0:
        return 0.0
    return len(_CJK_CHAR.findall(head)) / letters


def guess_script_language(text: str) -> str:
    """'zh' when CJK characters dominate, else 'en': the fallback when no langid step ran."""
    return "zh" if cjk_fraction(text) >= 0.3 else "en"
