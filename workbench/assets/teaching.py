"""The built-in teaching dataset: short questions about a tiny world, answered in one word.

Four relations (animal sounds, opposites, colours, capitals), each asked with several phrasings.
Every fact is seen in training, but one phrasing per fact is held out: a model that answers the
held-out questions has learnt the relation, not the sentence. A randomly initialised model answers
none of them; the built-in tiny model answers most of them after a minute or two of LoRA on two
CPU cores. The data is generated, deterministic, and written as alpaca-format jsonl.

    >>> rows = list(teaching_rows("heldout"))
    >>> rows[0]["instruction"], rows[0]["output"]  # doctest: +SKIP
    ('Which noise comes from a cow?', 'moo')
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

FACTS: dict[str, dict[str, str]] = {
    "sound": {
        "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa",
        "pig": "oink", "horse": "neigh", "owl": "hoot", "lion": "roar", "snake": "hiss",
        "bee": "buzz", "frog": "croak", "mouse": "squeak", "crow": "caw", "wolf": "howl",
        "goat": "bleat",
    },
    "opposite": {
        "hot": "cold", "cold": "hot", "big": "small", "small": "big", "up": "down",
        "down": "up", "fast": "slow", "slow": "fast", "happy": "sad", "sad": "happy",
        "light": "dark", "dark": "light", "early": "late", "late": "early", "full": "empty",
        "empty": "full", "wet": "dry", "dry": "wet", "loud": "quiet", "quiet": "loud",
    },
    "colour": {
        "banana": "yellow", "grass": "green", "sky": "blue", "snow": "white", "coal": "black",
        "blood": "red", "carrot": "orange", "plum": "purple", "lemon": "yellow",
        "leaf": "green", "cloud": "white", "tomato": "red",
    },
    "capital": {
        "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid",
        "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
        "China": "Beijing", "Canada": "Ottawa", "Greece": "Athens", "Chile": "Santiago",
    },
}

TEMPLATES: dict[str, list[str]] = {
    "sound": [
        "What sound does a {x} make?",
        "What does a {x} say?",
        "Which noise comes from a {x}?",
        "How does a {x} sound?",
    ],
    "opposite": [
        "What is the opposite of {x}?",
        "Give the opposite of the word {x}.",
        "Which word means the reverse of {x}?",
        "Opposite of {x}?",
    ],
    "colour": [
        "What colour is a {x}?",
        "Which colour does a {x} have?",
        "Name the colour of a {x}.",
        "A {x} is usually what colour?",
    ],
    "capital": [
        "What is the capital of {x}?",
        "Which city is the capital of {x}?",
        "Name the capital city of {x}.",
        "{x} has which capital?",
    ],
}

SPLITS = ("train", "heldout")


def _heldout_template(relation: str, entity: str) -> int:
    digest = hashlib.sha256(f"{relation}/{entity}".encode()).digest()
    return digest[0] % len(TEMPLATES[relation])


def teaching_rows(split: str = "train") -> Iterator[dict[str, str]]:
    """Alpaca rows (instruction, input, output) of one split: 'train' or 'heldout'."""
    if split not in SPLITS:
        raise ValueError(f"unknown teaching split {split!r}; use one of {SPLITS}")
    for relation, facts in FACTS.items():
        for entity, answer in facts.items():
            held = _heldout_template(relation, entity)
            for i, template in enumerate(TEMPLATES[relation]):
                if (i == held) == (split == "heldout"):
                    yield {"instruction": template.format(x=entity), "input": "", "output": answer}


def builtin_dataset_path(name: str = "builtin:teaching", split: str = "train") -> Path:
    """Write (once) and return the jsonl file of a built-in dataset split."""
    from workbench.assets.teaching_images import BUILTIN_IMAGE_DATASET, builtin_image_dataset_path

    if name == BUILTIN_IMAGE_DATASET:  # its PNGs are in images/ beside the jsonl
        return builtin_image_dataset_path(name, split)
    if name != "builtin:teaching":
        from workbench.errors import DatasetError

        raise DatasetError(f"unknown built-in dataset {name!r}; the built-in is 'builtin:teaching'")
    from workbench.runs.home import assets_dir

    path = assets_dir() / "teaching" / f"{split}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("w", encoding="utf-8") as fh:
            for row in teaching_rows(split):
                fh.write(json.dumps(row) + "\n")
        tmp.replace(path)
    return path


def score(answer: Callable[[Sequence[str]], Sequence[str]], split: str = "heldout") -> dict:
    """Accuracy of ``answer(questions) -> answers`` on a teaching split (exact first word).

    Returns ``{"accuracy", "correct", "total", "examples": [(question, expected, got), ...]}``.
    """
    rows = list(teaching_rows(split))
    got = list(answer([r["instruction"] for r in rows]))
    examples = []
    correct = 0
    for row, reply in zip(rows, got):
        words = reply.strip().split()
        first = words[0].strip(".,!?").lower() if words else ""
        ok = first == row["output"].lower()
        correct += ok
        examples.append((row["instruction"], row["output"], reply.strip()))
    return {"accuracy": correct / len(rows), "correct": correct, "total": len(rows),
            "examples": examples}
