"""Seeded, stable train/validation split by content hash.

An example's side depends only on its content and the seed, never on its position, so appending
data never moves an existing example from validation to train or back.

    >>> assign_split("What does a cow say?", fraction=0.1, seed=42) in ("train", "validation")
    True
"""

from __future__ import annotations

import hashlib


def assign_split(content: str, fraction: float, seed: int = 0) -> str:
    """'validation' for about ``fraction`` of all contents, else 'train'; stable across runs."""
    if fraction <= 0:
        return "train"
    digest = hashlib.blake2b(f"{seed}\x00{content}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    return "validation" if u < fraction else "train"
