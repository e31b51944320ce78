"""Quality heuristics from Gopher, C4 and FineWeb: cheap rules that catch boilerplate, spam,
lists, repeated text and non-prose, each named in the report when it removes a document.

Word-based rules count words with :func:`workbench.data.clean.tokens.words` (a CJK character is
one word). Rules that only make sense for space-separated languages (mean word length, the
English stop-word list) use their Chinese counterparts or are skipped for ``zh``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from workbench.data.clean.step import Doc, Step, check

# Gopher's stop words (Rae et al. 2021, App. A); the Chinese list is this project's analogue:
# the most frequent function characters of modern written Chinese.
EN_STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])
ZH_STOP_WORDS = frozenset("的了是在和有我不这也就都而及与着或")
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "–", "-", "*", "·")
_ELLIPSES = ("...", "…")
# FineWeb's line-end punctuation plus the Chinese full-width sentence ends.
_END_PUNCT = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…", "」", "』", ")", "）")


def _dup_fraction(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier item, fraction of characters in them)."""
    seen: set[str] = set()
    dup = dup_chars = total_chars = 0
    for it in items:
        total_chars += len(it)
        if it in seen:
            dup += 1
            dup_chars += len(it)
        else:
            seen.add(it)
    return dup / max(len(items), 1), dup_chars / max(total_chars, 1)


def _top_ngram_char_fraction(ws: list[str], n: int, total_chars: int) -> float:
    """Characters covered by the most frequent word n-gram over all word characters (Gopher).

    The reference definition (a Counter of n-gram tuples); :class:`_NGrams` computes the same
    value with numpy and is what :class:`QualityFilter` uses.
    """
    if len(ws) < n:
        return 0.0
    counts = Counter(zip(*(ws[i:] for i in range(n)), strict=False))
    gram, count = counts.most_common(1)[0]
    if count < 2:
        return 0.0
    return count * sum(len(w) for w in gram) / max(total_chars, 1)


def _dup_ngram_char_fraction(ws: list[str], n: int, total_chars: int) -> float:
    """Characters of words inside any n-gram that occurs more than once (Gopher).

    The reference definition; :class:`_NGrams` computes the same value with numpy.
    """
    if len(ws) < n:
        return 0.0
    grams = list(zip(*(ws[i:] for i in range(n)), strict=False))
    counts = Counter(grams)
    if counts.most_common(1)[0][1] < 2:
        return 0.0
    covered = [False] * len(ws)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            for j in range(i, i + n):
                covered[j] = True
    return sum(len(w) for w, c in zip(ws, covered, strict=True) if c) / max(total_chars, 1)


class _NGrams:
    """Word n-gram statistics of one document, computed once and shared by the n-gram rules.

    Exact, with numpy instead of Counters of tuples: words are numbered in order of first
    occurrence and a k-gram's key is its k word numbers as one base-V integer (V distinct words;
    re-numbered densely first when V**k would not fit in 63 bits), so equal keys mean equal
    n-grams. :meth:`top_fraction` and :meth:`dup_fraction` return exactly what
    :func:`_top_ngram_char_fraction` and :func:`_dup_ngram_char_fraction` return (ties between
    equally frequent n-grams go to the first to occur, as ``Counter.most_common`` does).

    :meth:`top_bound` is a cheap upper bound of :meth:`top_fraction` from word counts alone (an
    n-gram cannot occur more often than its rarest word): when the bound is within the limit the
    rule cannot fire and the exact value is not needed.
    """

    def __init__(self, ws: list[str], total_chars: int) -> None:
        self.n = len(ws)
        vocab = {w: i for i, w in enumerate(dict.fromkeys(ws))}  # first-occurrence order
        self.vocab_size = max(len(vocab), 1)
        self.ids = np.fromiter(map(vocab.__getitem__, ws), dtype=np.int64, count=self.n)
        self.lens = np.fromiter(map(len, ws), dtype=np.int64, count=self.n)
        self.prefix = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(self.lens, out=self.prefix[1:])
        self.total = max(total_chars, 1)
        self._keys: dict[int, tuple[np.ndarray, int]] = {1: (self.ids, self.vocab_size)}
        self._min_count: dict[int, np.ndarray] = {}

    def keys(self, k: int) -> np.ndarray:
        """Key of the k-gram starting at each position (``n - k + 1`` of them; needs n >= k)."""
        for j in range(len(self._keys) + 1, k + 1):
            prev, bound = self._keys[j - 1]  # every key of the (j-1)-grams is < bound
            if bound * self.vocab_size >= 1 << 63:  # re-number the (j-1)-grams densely
                uniq, prev = np.unique(prev, return_inverse=True)
                prev, bound = prev.reshape(-1), uniq.size
            self._keys[j] = (prev[:-1] * self.vocab_size + self.ids[j - 1:],
                             bound * self.vocab_size)
        return self._keys[k][0]

    def top_bound(self, k: int) -> float:
        """Upper bound of :meth:`top_fraction`: max over positions of (count of the rarest word
        of the k-gram there) x (its characters), over all word characters."""
        if k < 1:
            return math.inf
        if self.n < k:
            return 0.0
        if not self._min_count:
            self._min_count[1] = np.bincount(self.ids)[self.ids]
        for j in range(len(self._min_count) + 1, k + 1):
            self._min_count[j] = np.minimum(self._min_count[j - 1][:-1],
                                            self._min_count[1][j - 1:])
        chars = self.prefix[k:] - self.prefix[:-k]
        return int((self._min_count[k] * chars).max()) / self.total

    def _repeats(self, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Positions in k-gram key order (stable: equal n-grams stay in order of occurrence)
        and whether each entry in that order holds the same n-gram as the next one; None when
        no k-gram occurs twice."""
        if k < 1:  # as the reference functions (an empty Counter has no most common item)
            raise IndexError(f"n-gram size must be at least 1, got {k}")
        if self.n < k:
            return None
        keys = self.keys(k)
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        same = ordered[1:] == ordered[:-1]
        return (order, same) if same.any() else None

    def top_fraction(self, k: int) -> float:
        got = self._repeats(k)
        if got is None:
            return 0.0
        order, same = got
        begin = np.flatnonzero(np.concatenate(([True], ~same)))  # first entry of each n-gram
        counts = np.diff(begin, append=order.size)
        top = int(counts.max())
        pos = int(order[begin[counts == top]].min())  # first to occur of the most frequent
        return top * int(self.prefix[pos + k] - self.prefix[pos]) / self.total

    def dup_fraction(self, k: int) -> float:
        got = self._repeats(k)
        if got is None:
            return 0.0
        order, same = got
        in_group = np.zeros(order.size, dtype=bool)
        in_group[1:] = same
        in_group[:-1] |= same
        repeated = np.empty(order.size, dtype=bool)
        repeated[order] = in_group
        # Word j is covered when an n-gram starting in [j-k+1, j] repeats.
        cs = np.zeros(repeated.size + 1, dtype=np.int64)
        np.cumsum(repeated, out=cs[1:])
        j = np.arange(self.n)
        hi = np.minimum(j, repeated.size - 1) + 1
        lo = np.maximum(j - k + 1, 0)
        covered = cs[hi] > cs[lo]
        return int(self.lens[covered].sum()) / self.total


def _default_top_ngrams() -> dict[int, float]:
    return {2: 0.20, 3: 0.18, 4: 0.16}


def _default_dup_ngrams() -> dict[int, float]:
    return {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


@dataclass
class QualityFilter(Step):
    """Gopher quality + repetition rules, C4's lorem-ipsum rule and FineWeb's line rules.

    Defaults, by source:

    - Gopher quality filter (Rae et al. 2021, "Scaling Language Models", App. A): ``min_words=50``,
      ``max_words=100_000``, mean word length in ``[3, 10]`` (English),
      ``max_symbol_word_ratio=0.1``
      (``#`` and ellipses per word), ``max_bullet_lines=0.9``, ``max_ellipsis_lines=0.3``,
      ``min_alpha_words=0.8`` (words containing a letter; CJK characters are letters),
      ``min_stop_words=2`` (from the, be, to, of, and, that, have, with; Chinese: 的, 了, 是, ...).
    - Gopher repetition filter (same appendix): duplicate lines ``0.3`` of lines / ``0.2`` of
      characters, duplicate paragraphs ``0.3`` / ``0.2``, most frequent 2/3/4-gram covering more
      than ``0.20/0.18/0.16`` of characters, duplicated 5..10-grams covering more than
      ``0.15 .. 0.10`` of characters.
    - C4 (Raffel et al. 2020): drop pages containing "lorem ipsum".
    - FineWeb (Penedo et al. 2024): ``min_line_punct=0.12`` (share of lines ending in
      punctuation), ``max_short_lines=0.67`` (share of lines of at most 30 characters).

    For short instruction/chat rows the word-count rules are too strict: lower ``min_words``
    (e.g. ``{"quality": {"min_words": 3}}``). Any threshold can be set to ``null`` to turn its
    rule off.
    """

    name: ClassVar[str] = "quality"

    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines: float | None = 0.9
    max_ellipsis_lines: float | None = 0.3
    min_alpha_words: float | None = 0.8
    min_stop_words: int | None = 2
    max_dup_lines: float | None = 0.3
    max_dup_line_chars: float | None = 0.2
    max_dup_paragraphs: float | None = 0.3
    max_dup_paragraph_chars: float | None = 0.2
    max_top_ngram_chars: dict[int, float] = field(default_factory=_default_top_ngrams)
    max_dup_ngram_chars: dict[int, float] = field(default_factory=_default_dup_ngrams)
    lorem_ipsum: bool = True
    min_line_punct: float | None = 0.12
    max_short_lines: float | None = 0.67
    short_line_chars: int = 30

    def __post_init__(self) -> None:
        for key in ("max_top_ngram_chars", "max_dup_ngram_chars"):
            value = getattr(self, key)
            check(isinstance(value, dict), f"{key} must be a mapping n -> fraction")
            # YAML/JSON keys arrive as strings.
            setattr(self, key, {int(n): float(v) for n, v in value.items()})
        self._dup_ngrams = sorted(self.max_dup_ngram_chars.items())
        # The smallest limit from each entry on: once a fraction is within it, the rest are too.
        limits = [limit for _, limit in self._dup_ngrams]
        self._dup_rest_min = [min(limits[i:]) for i in range(len(limits))]

    def apply(self, doc: Doc) -> str | None:  # a flat list of rules, in Gopher's order
        text = doc.text
        zh = doc.language() == "zh"
        lower = text.lower()
        ws = doc.lower_words()  # lowercased once: stop words and n-grams compare lowercase
        n = len(ws)
        if self.min_words is not None and n < self.min_words:
            doc.detail = f"{n} words < {self.min_words}"
            return "gopher_min_words"
        if self.max_words is not None and n > self.max_words:
            doc.detail = f"{n} words > {self.max_words}"
            return "gopher_max_words"
        word_chars = len("".join(ws))
        if not zh and n:
            mean = word_chars / n
            if self.min_mean_word_length is not None and mean < self.min_mean_word_length:
                doc.detail = f"mean word length {mean:.1f} < {self.min_mean_word_length}"
                return "gopher_mean_word_length"
            if self.max_mean_word_length is not None and mean > self.max_mean_word_length:
                doc.detail = f"mean word length {mean:.1f} > {self.max_mean_word_length}"
                return "gopher_mean_word_length"
        if self.max_symbol_word_ratio is not None and n:
            symbols = text.count("#") + text.count("...") + text.count("…")
            if symbols / n > self.max_symbol_word_ratio:
                doc.detail = f"{symbols} symbols for {n} words"
                return "gopher_symbol_ratio"
        lines = [ln.strip() for ln in text.split("\n")]
        lines = [ln for ln in lines if ln]
        nl = max(len(lines), 1)
        if self.max_bullet_lines is not None:
            bullets = sum(ln.startswith(_BULLETS) for ln in lines)
            if bullets / nl > self.max_bullet_lines:
                doc.detail = f"{bullets} of {nl} lines start with a bullet"
                return "gopher_bullet_lines"
        if self.max_ellipsis_lines is not None:
            ell = sum(ln.endswith(_ELLIPSES) for ln in lines)
            if ell / nl > self.max_ellipsis_lines:
                doc.detail = f"{ell} of {nl} lines end with an ellipsis"
                return "gopher_ellipsis_lines"
        if self.min_alpha_words is not None and n:
            # A word is a \\w run: without a letter it is (almost always) all digits.
            alpha = n - sum(map(str.isdigit, ws))
            if alpha / n < self.min_alpha_words:
                doc.detail = f"{alpha / n:.0%} of words contain a letter"
                return "gopher_alpha_words"
        if self.min_stop_words is not None:
            stops = ZH_STOP_WORDS if zh else EN_STOP_WORDS
            found = 0
            for w in ws:
                if w in stops:
                    found += 1
                    if found >= self.min_stop_words:
                        break
            if found < self.min_stop_words:
                doc.detail = f"{found} stop words < {self.min_stop_words}"
                return "gopher_stop_words"
        if self.lorem_ipsum and "lorem ipsum" in lower:
            doc.detail = "contains 'lorem ipsum'"
            return "c4_lorem_ipsum"
        frac, chars = _dup_fraction(lines)
        if self.max_dup_lines is not None and frac > self.max_dup_lines:
            doc.detail = f"{frac:.0%} of lines are repeats"
            return "gopher_dup_lines"
        if self.max_dup_line_chars is not None and chars > self.max_dup_line_chars:
            doc.detail = f"{chars:.0%} of characters are in repeated lines"
            return "gopher_dup_line_chars"
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        frac, chars = _dup_fraction(paragraphs)
        if self.max_dup_paragraphs is not None and frac > self.max_dup_paragraphs:
            doc.detail = f"{frac:.0%} of paragraphs are repeats"
            return "gopher_dup_paragraphs"
        if self.max_dup_paragraph_chars is not None and chars > self.max_dup_paragraph_chars:
            doc.detail = f"{chars:.0%} of characters are in repeated paragraphs"
            return "gopher_dup_paragraph_chars"
        grams = _NGrams(ws, word_chars)
        for k, limit in self.max_top_ngram_chars.items():
            if grams.top_bound(k) <= limit:
                continue  # the exact fraction is at most the bound: the rule cannot fire
            f = grams.top_fraction(k)
            if f > limit:
                doc.detail = f"most frequent {k}-gram covers {f:.0%} of characters"
                return "gopher_top_ngram"
        bound = math.inf  # words covered by repeated k-grams are covered by repeated (k-1)-grams
        for (k, limit), rest in zip(self._dup_ngrams, self._dup_rest_min, strict=True):
            if bound <= rest:
                break  # no later fraction can exceed its limit (each is at most ``bound``)
            f = bound = grams.dup_fraction(k)
            if f > limit:
                doc.detail = f"repeated {k}-grams cover {f:.0%} of characters"
                return "gopher_dup_ngram"
            if f == 0.0:
                break  # no repeated k-gram means no repeated (k+1)-gram either
        if self.min_line_punct is not None:
            punct = sum(ln.endswith(_END_PUNCT) for ln in lines)
            if punct / nl < self.min_line_punct:
                doc.detail = f"{punct} of {nl} lines end in punctuation"
                return "fineweb_line_punct"
        if self.max_short_lines is not None and nl > 1:
            short = sum(len(ln) <= self.short_line_chars for ln in lines)
            if short / nl > self.max_short_lines:
                doc.detail = f"{short} of {nl} lines have <= {self.short_line_chars} chars"
                return "fineweb_short_lines"
        return None
