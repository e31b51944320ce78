"""Seeded, stable train/validation split by content hash.

An example's side depends only on its content and the seed, never on its position, so appending
data never moves an existing example from validation to train or back.

    >>> assign_split("What does a cow say?", fraction=0.1, seed=42) in ("train", "validation")
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path


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
    import json

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
