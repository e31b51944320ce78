"""Seeded, stable train/validation split by content hash.

An example's side depends only on its content and the seed, never on its position, so appending
data never moves an existing example from validation to train or back.

    >>> assign_split("What does a cow say?", fraction=0.1, seed=42) in ("train", "validation")
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from workbench.errors import EmptyDatasetError


def assign_split(content: str, fraction: float, seed: int = 0) -> str:
    """'validation' for about ``fraction`` of all contents, else 'train'; stable across runs."""
    if fraction <= 0:
        return "train"
    digest = hashlib.blake2b(f"{seed}\x00{content}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    return "validation" if u < fraction else "train"


def split_records(rows: Iterable[dict], fraction: float, seed: int = 0,
                  text_fields: Sequence[str] = ("text",)) -> Iterator[tuple[str, dict]]:
    """Yield ``(side, row)`` for each row, side from :func:`assign_split` on its text fields."""
    for row in rows:
        yield assign_split("\n\n".join(row[f] for f in text_fields), fraction, seed), row


def split_file(in_path: str | Path, out_dir: str | Path, fraction: float = 0.1,
               seed: int = 42, text_fields: Sequence[str] = ("text",)) -> dict[str, int]:
    """Stream ``in_path`` (.jsonl/.txt) into ``out_dir/train.jsonl`` and
    ``out_dir/validation.jsonl``; returns the row count of each side.

    A row's side depends only on its text and ``seed``: appending rows to the input never moves
    an existing row to the other side.
    """
    from workbench.data.clean.reading import read_records

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "validation": 0}
    with (out / "train.jsonl").open("w", encoding="utf-8") as train, \
            (out / "validation.jsonl").open("w", encoding="utf-8") as val:
        files = {"train": train, "validation": val}
        for side, row in split_records(read_records(in_path, text_fields), fraction, seed,
                                       text_fields):
            files[side].write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[side] += 1
    return counts


class SplitWriter:
    """Rows written to ``out_dir``/train.jsonl and validation.jsonl by :func:`assign_split` of a
    key, counted per side and per source, the first five kept for a preview. An empty source and
    a data set that leaves no training row are errors saying what to do.

        >>> with SplitWriter(out, fraction=0.1, seed=42) as w:  # doctest: +SKIP
        ...     w.write(key, row); w.end_source("train.jsonl", rows=1)
        >>> w.counts
        {'train': 1, 'validation': 0}
    """

    def __init__(self, out_dir: str | Path, fraction: float, seed: int) -> None:
        self.fraction, self.seed = fraction, seed
        self.counts = {"train": 0, "validation": 0}
        self.per_source: list[dict] = []
        self.preview: list[dict] = []
        out = Path(out_dir)
        self._files = {s: (out / f"{s}.jsonl").open("w", encoding="utf-8") for s in self.counts}

    def write(self, key: str, row: dict) -> None:
        side = assign_split(key, self.fraction, self.seed)
        self._files[side].write(json.dumps(row, ensure_ascii=False) + "\n")
        self.counts[side] += 1
        if len(self.preview) < 5:
            self.preview.append(row)

    def end_source(self, path: str, rows: int) -> None:
        """Record a source's row count; a source without rows is refused."""
        if rows == 0:
            raise EmptyDatasetError(f"dataset {path!r} has no rows; give a non-empty file or "
                                    "remove the source")
        self.per_source.append({"path": path, "rows": rows})

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        for fh in self._files.values():
            fh.close()
        if exc_type is None and self.counts["train"] == 0:
            raise EmptyDatasetError(f"no training rows are left ({self.counts['validation']} went "
                                    "to validation); add data or lower data.validation_fraction")
