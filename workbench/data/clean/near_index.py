"""The parent-process index of the near-duplicate step: LSH candidates, each verified.

A document's key (made in a worker by :meth:`workbench.data.clean.dedup.NearDedup.key`) is its
LSH band keys plus a *sketch* of its shingle set: the ``k`` smallest distinct shingle ids
(bottom-k), which is the whole set when the document has at most ``k`` distinct shingles. The
index maps band keys to the documents kept so far (a numpy multimap) and stores their sketches
in one growing uint32 array, so memory per kept document is at most ``4 k`` bytes plus the band
keys. A band match only makes a *candidate*; the candidate removes the new document only when
their Jaccard similarity is at least the threshold:

- exact (``method="exact"``) when both sketches hold the whole shingle set: ``|A∩B| / |A∪B|``
  over 32-bit shingle ids (a false match of two different shingles has odds ~n/2³², about 1e-7
  per shingle of a 1 KB document);
- otherwise estimated (``"estimated"``) from the bottom-k sketch of the union, the k smallest
  of both sketches together: the share of them that lies in both sets (standard error
  ``sqrt(J(1-J)/k)``, 0.027 at J = 0.75 with k = 256).

    >>> index = NearDupIndex(threshold=0.5, sketch_size=4)
    >>> a = ([11, 22], np.array([1, 2, 3], dtype=np.uint32), True)
    >>> index.check(a, row=1) is None
    True
    >>> index.check(([11, 99], np.array([1, 2, 3, 4], dtype=np.uint32), True), row=2)
    NearMatch(kept_row=1, similarity=0.75, method='exact')
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.data.clean.step import DedupIndex

#: What NearDedup.key returns: (band keys, sorted distinct shingle ids (at most k), whole set?).
NearKey = tuple[list[int], np.ndarray, bool]


@dataclass(frozen=True)
class NearMatch:
    """The kept document a new one duplicates: its input row (1-based) and their similarity."""

    kept_row: int
    similarity: float
    method: str  # "exact" or "estimated"


def sketch_similarity(a: np.ndarray, a_whole: bool, b: np.ndarray, b_whole: bool,
                      k: int) -> tuple[float, str]:
    """Jaccard similarity of two sets from their sorted bottom-k sketches (see the module)."""
    if a_whole and b_whole:
        inter = np.intersect1d(a, b, assume_unique=True).size
        return inter / (a.size + b.size - inter), "exact"
    # The k smallest of A∪B are the k smallest of the two sketches together, and one of them
    # lies in A exactly when it lies in A's sketch.
    union = np.union1d(a, b)[:k]
    both = np.isin(union, a, assume_unique=True) & np.isin(union, b, assume_unique=True)
    return int(both.sum()) / union.size, "estimated"


class _Grow:
    """A numpy array that doubles when full (amortised O(1) appends)."""

    def __init__(self, dtype: type, capacity: int = 1024) -> None:
        self.data: np.ndarray = np.zeros(capacity, dtype=dtype)
        self.size = 0

    def extend(self, values: np.ndarray | list) -> None:
        n = len(values)
        if self.size + n > self.data.size:
            bigger = np.zeros(max(2 * self.data.size, self.size + n), dtype=self.data.dtype)
            bigger[: self.size] = self.data[: self.size]
            self.data = bigger
        self.data[self.size:self.size + n] = values
        self.size += n


class NearDupIndex(DedupIndex):
    """Band keys and sketches of the documents kept so far; :meth:`check` decides on a new one."""

    def __init__(self, threshold: float, sketch_size: int, capacity: int = 1 << 16) -> None:
        self.threshold, self.k = threshold, sketch_size
        capacity = 1 << max(4, (capacity - 1).bit_length())
        self._keys = np.zeros(capacity, dtype=np.uint64)  # 0 marks an empty slot
        self._ids = np.zeros(capacity, dtype=np.uint32)
        self._used = 0
        self._sketch = _Grow(np.uint32, 1 << 16)
        self._start = _Grow(np.int64)  # document d's sketch is _sketch[_start[d]:_start[d+1]]
        self._start.extend([0])
        self._whole = _Grow(np.bool_)
        self._row = _Grow(np.int64)
        #: Candidates verified, and how many of them were not similar enough (for the report).
        self.verified = self.rejected = 0

    def __len__(self) -> int:
        return self._row.size

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self._keys, self._ids, self._sketch.data,
                                           self._start.data, self._whole.data, self._row.data))

    def _candidates(self, keys: list[int]) -> set[int]:
        table, ids, mask = self._keys, self._ids, self._keys.size - 1
        found: set[int] = set()
        for key in keys:
            key = key or 1
            i = key & mask
            while (v := table.item(i)) != 0:
                if v == key:
                    found.add(ids.item(i))
                i = (i + 1) & mask
        return found

    def best_match(self, key: NearKey) -> NearMatch | None:
        """The most similar kept document at or above the threshold (the earliest on a tie),
        or None. Changes nothing."""
        bands, sketch, whole = key
        found = self._candidates(bands)
        if not found:
            return None
        ids = np.array(sorted(found), dtype=np.int64)
        sims = np.empty(ids.size)
        exact = self._whole.data[ids] & whole
        if exact.any():
            sims[exact] = self._exact_similarities(sketch, ids[exact])
        starts, store = self._start.data, self._sketch.data
        for i in np.flatnonzero(~exact).tolist():
            d = ids[i]
            sims[i] = sketch_similarity(sketch, whole, store[starts[d]:starts[d + 1]],
                                        bool(self._whole.data[d]), self.k)[0]
        self.verified += ids.size
        ok = sims >= self.threshold
        self.rejected += ids.size - int(ok.sum())
        if not ok.any():
            return None
        i = int(np.argmax(np.where(ok, sims, -1.0)))  # the first of equal maxima: the earliest
        return NearMatch(int(self._row.data[ids[i]]), float(sims[i]),
                         "exact" if exact[i] else "estimated")

    def _exact_similarities(self, sketch: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Exact Jaccard of the whole set ``sketch`` with each of the documents ``ids`` (whole
        sets too), in one pass over their concatenated sketches: a busy LSH bucket (many
        documents from one template) costs numpy work, not a Python loop per candidate."""
        begin, end = self._start.data[ids], self._start.data[ids + 1]
        lens = end - begin
        offsets = np.cumsum(lens) - lens
        values = self._sketch.data[np.arange(int(lens.sum())) + np.repeat(begin - offsets, lens)]
        pos = np.minimum(np.searchsorted(sketch, values), sketch.size - 1)
        inter = np.add.reduceat((sketch[pos] == values).astype(np.int64), offsets)
        return inter / (sketch.size + lens - inter)

    def add(self, key: NearKey, row: int) -> None:
        """Remember a kept document (``row``: its 1-based position in the input)."""
        bands, sketch, whole = key
        doc = self._row.size
        self._row.extend([row])
        self._whole.extend([whole])
        self._sketch.extend(sketch)
        self._start.extend([self._sketch.size])
        if (self._used + len(bands)) * 2 > self._keys.size:  # keep the load factor under 1/2
            self._grow()
        for k in bands:
            self._put(k or 1, doc)

    def check(self, key: NearKey, row: int) -> NearMatch | None:
        """The match that makes the document a near-duplicate, or None after adding it."""
        match = self.best_match(key)
        if match is None:
            self.add(key, row)
        return match

    def seen(self, key: NearKey) -> bool:  # type: ignore[override]
        return self.check(key, -1) is not None

    def _put(self, key: int, doc: int) -> None:
        mask = self._keys.size - 1
        i = key & mask
        while self._keys.item(i) != 0:
            i = (i + 1) & mask
        self._keys[i] = key
        self._ids[i] = doc
        self._used += 1

    def _grow(self) -> None:
        used = self._keys != 0
        keys, ids = self._keys[used], self._ids[used]
        self._keys = np.zeros(self._keys.size * 2, dtype=np.uint64)
        self._ids = np.zeros(self._keys.size, dtype=np.uint32)
        self._used = int(keys.size)
        mask = self._keys.size - 1
        pos = (keys & np.uint64(mask)).astype(np.int64)
        # Linear probing in bulk: each round fills every free slot asked for with one of the
        # keys asking for it; the others move one slot on, past a slot that is now taken.
        while keys.size:
            free = np.flatnonzero(self._keys[pos] == 0)
            _, first = np.unique(pos[free], return_index=True)
            placed = free[first]
            self._keys[pos[placed]] = keys[placed]
            self._ids[pos[placed]] = ids[placed]
            rest = np.ones(keys.size, dtype=bool)
            rest[placed] = False
            keys, ids, pos = keys[rest], ids[rest], (pos[rest] + 1) & mask
