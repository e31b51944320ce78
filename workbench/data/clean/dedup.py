"""Exact and near-duplicate (MinHash LSH, verified) document dedup, with vectorised numpy hashing.

Both steps keep the first occurrence in input order. Per-document hashing (the expensive part)
runs in worker processes; the "seen before?" sets live in the parent (:class:`U64Set`, a
numpy open-addressing table of 64-bit keys, ~16-32 bytes per key instead of ~80 for a Python
``set`` of ints; for near dedup :class:`~workbench.data.clean.near_index.NearDupIndex`, which
also verifies each LSH candidate), so dedup is correct across workers and memory stays small per
document.

MinHash: words come from :func:`workbench.data.clean.tokens.words` (one word per CJK character,
so Chinese gets character shingles), each word gets a stable 64-bit id (blake2b, cached per
process), a shingle id is a polynomial combination of ``shingle_size`` consecutive word ids, and
the ``num_perm`` hash functions are multiply-shift hashes ``(a*x + b) >> 32`` over 64-bit
integers, evaluated for all shingles x all permutations as one numpy matrix.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from workbench.data.clean.near_index import NearDupIndex, NearKey
from workbench.data.clean.step import DedupIndex, DedupStep, Doc, check
from workbench.data.clean.tokens import CJK_RANGES

_SEP, _CJK, _WORD = 0, 1, 2
_P = 0x9E3779B97F4A7C15  # odd, so it has an inverse mod 2^64
_CLASSES: np.ndarray | None = None
_POW: tuple[np.ndarray, np.ndarray] | None = None
_BLOCK = 256  # shingles hashed at a time by MinHasher.signature


def _char_classes() -> np.ndarray:
    """Class of every BMP code point: word character (as regex ``\\w``), CJK, or separator."""
    global _CLASSES
    if _CLASSES is None:
        table = np.array([_WORD if (chr(i).isalnum() or i == 0x5F) else _SEP
                          for i in range(0x10000)], dtype=np.uint8)
        for lo, hi in re.findall("(.)-(.)", CJK_RANGES):
            table[ord(lo):ord(hi) + 1] = _CJK
        _CLASSES = table
    return _CLASSES


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P^k and P^-k mod 2^64 for k < n (grown on demand, shared by all hashers)."""
    global _POW
    if _POW is None or _POW[0].size < n:
        size = max(n, 1 << 16)
        pw = np.full(size, _P, dtype=np.uint64)
        pw[0] = 1
        pinv = np.full(size, pow(_P, -1, 1 << 64), dtype=np.uint64)
        pinv[0] = 1
        _POW = (np.cumprod(pw, dtype=np.uint64), np.cumprod(pinv, dtype=np.uint64))
    return _POW


def hash64(text: str) -> int:
    """Stable 64-bit hash of ``text`` (the same in every process and on every run)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class U64Set(DedupIndex):
    """A growable set of non-zero 64-bit keys in one numpy array (linear probing).

    ``seen(keys)`` answers "was any of these keys added before?" and, when none was, adds them
    all: exactly the streaming rule "a document is a duplicate if it collides with a kept one".
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        capacity = 1 << max(4, (capacity - 1).bit_length())
        self._table = np.zeros(capacity, dtype=np.uint64)
        self._mask = capacity - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _find(self, key: int) -> tuple[bool, int]:
        table, mask = self._table, self._mask
        i = key & mask
        while True:
            v = table.item(i)
            if v == 0:
                return False, i
            if v == key:
                return True, i
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = self._table[self._table != 0]
        self._table = np.zeros(self._table.size * 2, dtype=np.uint64)
        self._mask = self._table.size - 1
        self._count = 0
        for k in old.tolist():
            self._insert(k)

    def _insert(self, key: int) -> None:
        found, i = self._find(key)
        if not found:
            self._table[i] = key
            self._count += 1

    def seen(self, keys: int | list[int]) -> bool:  # type: ignore[override]
        ks = [keys] if isinstance(keys, int) else keys
        ks = [k or 1 for k in ks]  # 0 marks an empty slot
        if any(self._find(k)[0] for k in ks):
            return True
        if (self._count + len(ks)) * 2 > self._table.size:  # keep the load factor under 1/2
            self._grow()
        for k in ks:
            self._insert(k)
        return False


@dataclass
class ExactDedup(DedupStep):
    """Drop documents whose (normalised) text is identical to an earlier document's.

    Key: a 64-bit blake2b hash of the joined text fields after the steps before this one (run
    ``normalize`` first so whitespace/Unicode variants match). With 64-bit keys the chance of a
    false match is ~n²/2⁶⁵: below 1e-7 for 1e6 documents. ``lowercase=True`` also merges
    case variants (off by default, as in C4's exact three-sentence-span dedup which is case
    sensitive).
    """

    name: ClassVar[str] = "exact_dedup"

    lowercase: bool = False

    def key(self, doc: Doc) -> int:
        text = doc.text.lower() if self.lowercase else doc.text
        return hash64(text)

    def new_index(self) -> U64Set:
        return U64Set()


def candidate_bands(threshold: float, num_perm: int, min_recall: float = 0.995
                    ) -> tuple[int, int]:
    """(bands, rows) for LSH candidates that are verified afterwards: the most rows per band
    (the fewest dissimilar candidates to verify) such that a pair at exactly ``threshold``
    still becomes a candidate with probability >= ``min_recall``.

    >>> candidate_bands(0.75, 112)
    (22, 5)
    """
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1.0 - (1.0 - threshold**rows) ** bands >= min_recall:
            return bands, rows
    return num_perm, 1


class MinHasher:
    """MinHash signatures and LSH band keys of texts (CJK-aware word shingles).

    >>> mh = MinHasher(num_perm=16, bands=4, shingle_size=3)
    >>> a = mh.signature("the cat sat on the mat today")
    >>> bool((a == mh.signature("the cat sat on the mat today")).all())
    True
    """

    def __init__(self, num_perm: int = 112, bands: int = 14, shingle_size: int = 5,
                 seed: int = 1) -> None:
        self.num_perm, self.bands, self.shingle_size = num_perm, bands, shingle_size
        self.rows = num_perm // bands
        rng = np.random.default_rng(seed)
        # Odd multipliers make x -> a*x mod 2^64 a bijection; the top 32 bits of a*x + b are a
        # 2-universal hash of x (Dietzfelbinger's multiply-shift).
        self._a = (rng.integers(1, 2**63, num_perm, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)
        self._b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self._shingle_mul = (rng.integers(1, 2**63, shingle_size, dtype=np.uint64)
                             << np.uint64(1)) | np.uint64(1)
        self._band_mul = (rng.integers(1, 2**63, self.rows, dtype=np.uint64)
                          << np.uint64(1)) | np.uint64(1)
        self._band_salt = rng.integers(1, 2**63, bands, dtype=np.uint64)

    def word_ids(self, text: str) -> np.ndarray:
        """Stable 64-bit ids of the text's words (lowercased), in order, computed without a
        Python loop: a polynomial hash over code points, differenced between word boundaries."""
        cp = np.frombuffer(text.lower().encode("utf-32-le"), dtype=np.uint32)
        n = cp.size
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        cls = _char_classes()[np.minimum(cp, 0xFFFF)]
        sup = cp > 0xFFFF
        if sup.any():  # CJK extension B..G are words, other astral characters (emoji) are not
            big = cp[sup]
            cls[sup] = np.where((big >= 0x20000) & (big <= 0x3134F), _CJK, _SEP)
        is_w = cls == _WORD
        is_c = cls == _CJK
        prev_w = np.empty(n, dtype=bool)
        prev_w[0] = False
        prev_w[1:] = is_w[:-1]
        next_w = np.empty(n, dtype=bool)
        next_w[-1] = False
        next_w[:-1] = is_w[1:]
        starts = np.flatnonzero(is_c | (is_w & ~prev_w))
        ends = np.flatnonzero(is_c | (is_w & ~next_w)) + 1
        if starts.size == 0:
            return np.zeros(0, dtype=np.uint64)
        pw, pinv = _powers(n + 1)
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum((cp.astype(np.uint64) + np.uint64(1)) * pw[:n], out=prefix[1:])
        # sum_k c_k P^(k-start) over the word: position-independent, wraps mod 2^64 on purpose.
        ids = (prefix[ends] - prefix[starts]) * pinv[starts]
        ids ^= ids >> np.uint64(31)
        ids *= np.uint64(0x94D049BB133111EB)
        ids ^= ids >> np.uint64(29)
        return ids

    def shingles(self, text: str) -> np.ndarray:
        """32-bit ids of the text's word shingles, as uint64."""
        ids = self.word_ids(text)
        n = self.shingle_size
        if ids.size == 0:
            return np.zeros(1, dtype=np.uint64)
        if ids.size < n:  # a short text is one shingle
            n = ids.size
        m = ids.size - n + 1
        acc = ids[:m] * self._shingle_mul[0]
        for j in range(1, n):
            acc += ids[j:j + m] * self._shingle_mul[j]
        return (acc ^ (acc >> np.uint64(32))) & np.uint64(0xFFFFFFFF)

    def signature(self, text: str) -> np.ndarray:
        """``num_perm`` minimum hash values (uint64 holding 32-bit values)."""
        return self.minhash(self.shingles(text))

    def minhash(self, x: np.ndarray) -> np.ndarray:
        """The signature of the shingle ids ``x`` (as returned by :meth:`shingles`)."""
        # The (shingles x num_perm) hash matrix is made _BLOCK rows at a time so that it stays
        # in cache; the minimum of the blocks' minima is the minimum of the whole matrix.
        buf = np.empty((min(x.size, _BLOCK), self.num_perm), dtype=np.uint64)
        sig: np.ndarray | None = None
        for start in range(0, x.size, _BLOCK):
            h = buf[: min(_BLOCK, x.size - start)]
            np.multiply(x[start:start + _BLOCK, None], self._a, out=h)
            h += self._b
            low = h.min(axis=0)
            sig = low if sig is None else np.minimum(sig, low, out=sig)
        assert sig is not None  # shingles() returns at least one value
        # floor(v / 2^32) is monotone, so shifting the column minima equals minimising the
        # shifted values: one pass over the matrix saved.
        return sig >> np.uint64(32)

    def band_keys(self, signature: np.ndarray) -> list[int]:
        """One 64-bit key per LSH band (salted with the band number, never 0)."""
        sig = signature[: self.bands * self.rows].reshape(self.bands, self.rows)
        k = (sig * self._band_mul).sum(axis=1, dtype=np.uint64) ^ self._band_salt
        k ^= k >> np.uint64(29)
        k *= np.uint64(0xBF58476D1CE4E5B9)
        k ^= k >> np.uint64(32)
        return k.tolist()

    def keys(self, text: str) -> list[int]:
        return self.band_keys(self.signature(text))


def jaccard(a: set[str], b: set[str]) -> float:
    """Exact Jaccard similarity of two sets (used by tests and the benchmark to check MinHash)."""
    return len(a & b) / len(a | b) if a or b else 1.0


@dataclass
class NearDedup(DedupStep):
    """Drop documents whose shingle-set Jaccard similarity with an earlier kept document is at
    least ``threshold``; MinHash LSH finds the candidates, and each one is verified.

    Shingles follow FineWeb's MinHash dedup (Penedo et al. 2024; datatrove ``MinhashConfig``):
    ``shingle_size=5`` word 5-grams (a CJK character counts as a word, so Chinese gets
    character 5-grams), ``num_perm=112`` hashes, and ``threshold=0.75``, the similarity FineWeb
    targets. Unlike datatrove, a band match is not the decision: on a corpus where many pairs
    share a paragraph or a template, banding alone removes many documents that are not
    near-duplicates. So ``bands`` (None: chosen by :func:`candidate_bands`, 22 bands x 5 rows
    for 0.75) is set low enough that a pair at the threshold becomes a candidate with
    probability >= 0.995, and every candidate is checked against the threshold by the exact
    Jaccard of the two shingle sets when both have at most ``sketch_size`` distinct shingles
    (about 1,300 characters of English), else by the Jaccard estimated from their bottom-k
    sketches (:mod:`workbench.data.clean.near_index`). Memory per kept document: at most
    4 x ``sketch_size`` bytes plus 24-48 bytes per band (about 1.9 KB at the defaults).
    """

    name: ClassVar[str] = "near_dedup"

    shingle_size: int = 5
    num_perm: int = 112
    threshold: float = 0.75
    bands: int | None = None
    sketch_size: int = 256
    seed: int = 1

    def __post_init__(self) -> None:
        check(self.shingle_size >= 1, "shingle_size must be >= 1")
        check(1 <= self.num_perm <= 1024, "num_perm must be between 1 and 1024")
        check(isinstance(self.threshold, (int, float)) and 0.0 < self.threshold < 1.0,
              "threshold must be between 0 and 1 (the Jaccard similarity of two documents' "
              "shingle sets at which they count as near-duplicates, e.g. 0.75)")
        if self.bands is None:
            self.bands, _ = candidate_bands(self.threshold, self.num_perm)
        check(1 <= self.bands <= self.num_perm, "bands must be between 1 and num_perm "
              "(or leave it out to choose it from threshold)")
        check(16 <= self.sketch_size <= 1 << 16, "sketch_size must be between 16 and 65536")
        self._hasher: MinHasher | None = None

    @property
    def rows(self) -> int:
        return self.num_perm // self.band_count

    @property
    def band_count(self) -> int:
        assert self.bands is not None  # set by __post_init__
        return self.bands

    def hasher(self) -> MinHasher:
        if self._hasher is None:
            self._hasher = MinHasher(self.num_perm, self.band_count, self.shingle_size,
                                     self.seed)
        return self._hasher

    def __getstate__(self) -> dict:
        # Workers rebuild the hasher (and its word-id cache) themselves.
        return {**self.__dict__, "_hasher": None}

    def key(self, doc: Doc) -> NearKey:
        h = self.hasher()
        x = np.sort(h.shingles(doc.text))
        # Distinct shingles, sorted, so the first k are the bottom-k sketch (a sort and a
        # neighbour compare cost less than np.unique on a few hundred values); the signature of
        # the distinct ones is the same.
        first = np.empty(x.size, dtype=bool)
        first[0] = True
        np.not_equal(x[1:], x[:-1], out=first[1:])
        distinct = x[first]
        k = self.sketch_size
        return (h.band_keys(h.minhash(distinct)), distinct[:k].astype(np.uint32),
                distinct.size <= k)

    def new_index(self) -> NearDupIndex:
        return NearDupIndex(self.threshold, self.sketch_size)
