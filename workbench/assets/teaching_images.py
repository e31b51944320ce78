"""The built-in image teaching set: drawn shapes, asked about their colour, kind and number.

Two kinds of picture, drawn with PIL on a white 84x84 canvas (nine tokens for the tiny VLM):
one shape (asked "What colour is the shape?" and "What shape is it?") and a few shapes of one kind
(asked "How many circles are there?"). Every fact (colour and kind, or kind and count) is drawn
several times at different places and sizes; one drawing per fact, chosen by hash, is held out,
so a model that answers the held-out pictures reads the picture, not its file. Generated offline
and deterministically, written as TRL / OpenAI messages with image parts whose images are PNG
files beside the jsonl, named by relative path.

    >>> rows = list(image_teaching_rows("train"))
    >>> rows[0]["question"], rows[0]["answer"]
    ('What colour is the shape?', 'red')
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

BUILTIN_IMAGE_DATASET = "builtin:teaching-images"
SIZE = 84
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
COUNTS = (1, 2, 3, 4)
DRAWINGS = 3  # drawings of each fact; one of them is held out
SPLITS = ("train", "heldout")


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def _held_out(fact: str) -> int:
    return _seed(fact) % DRAWINGS


def _shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float,
           fill: tuple[int, int, int]) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def draw_image(name: str) -> Image.Image:
    """The picture a teaching image name describes: ``one-COLOUR-SHAPE-I`` or
    ``count-N-SHAPE-COLOUR-I`` (I: which drawing); the same name always gives the same pixels."""
    rng = random.Random(_seed(name))
    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(image)
    parts = name.split("-")
    if parts[0] == "one":
        colour, kind = parts[1], parts[2]
        r = rng.uniform(14, 24)
        _shape(draw, kind, rng.uniform(r + 2, SIZE - r - 2), rng.uniform(r + 2, SIZE - r - 2), r,
               COLOURS[colour])
    else:
        count, kind, colour = int(parts[1]), parts[2], parts[3]
        half = SIZE // 2
        for cell in rng.sample(range(4), count):  # one shape per quarter: never overlapping
            r = rng.uniform(8, 13)
            x0, y0 = (cell % 2) * half, (cell // 2) * half
            _shape(draw, kind, x0 + rng.uniform(r + 2, half - r - 2),
                   y0 + rng.uniform(r + 2, half - r - 2), r, COLOURS[colour])
    return image


def image_teaching_rows(split: str = "train") -> Iterator[dict[str, str]]:
    """Rows ``{"image": NAME.png, "question", "answer"}`` of one split: 'train' or 'heldout'."""
    if split not in SPLITS:
        raise ValueError(f"unknown teaching split {split!r}; use one of {SPLITS}")
    for colour in COLOURS:
        for kind in SHAPES:
            for i in _drawings(f"one-{colour}-{kind}", split):
                image = f"one-{colour}-{kind}-{i}.png"
                yield {"image": image, "question": "What colour is the shape?", "answer": colour}
                yield {"image": image, "question": "What shape is it?", "answer": kind}
    for kind in ("circle", "square"):
        for count in COUNTS:
            for colour in COLOURS:
                for i in _drawings(f"count-{count}-{kind}-{colour}", split):
                    yield {"image": f"count-{count}-{kind}-{colour}-{i}.png",
                           "question": f"How many {kind}s are there?", "answer": str(count)}


def _drawings(fact: str, split: str) -> list[int]:
    held = _held_out(fact)
    return [i for i in range(DRAWINGS) if (i == held) == (split == "heldout")]


def to_messages(row: dict[str, str], images: str = "images") -> dict[str, Any]:
    """A teaching row as TRL / OpenAI messages, the image named relative to the jsonl."""
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": f"{images}/{row['image']}"},
                                     {"type": "text", "text": row["question"]}]},
        {"role": "assistant", "content": [{"type": "text", "text": row["answer"]}]},
    ]}


def builtin_image_dataset_path(name: str = BUILTIN_IMAGE_DATASET, split: str = "train") -> Path:
    """Write (once) and return the jsonl of a split; its PNGs are in ``images/`` beside it."""
    if name != BUILTIN_IMAGE_DATASET:
        from workbench.errors import DatasetError

        raise DatasetError(f"unknown built-in image dataset {name!r}; the built-in is "
                           f"{BUILTIN_IMAGE_DATASET!r}")
    if split not in SPLITS:
        raise ValueError(f"unknown teaching split {split!r}; use one of {SPLITS}")
    from workbench.runs.home import assets_dir

    folder = assets_dir() / "teaching-images"
    path = folder / f"{split}.jsonl"
    if path.is_file():
        return path
    rows = list(image_teaching_rows(split))
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for name in sorted({row["image"] for row in rows}):
        target = folder / "images" / name
        if not target.is_file():
            tmp = target.with_name(f"{name}.tmp{os.getpid()}")
            draw_image(name.removesuffix(".png")).save(tmp, format="PNG")
            tmp.replace(target)
    # The jsonl goes last, so its presence means every image it names is there.
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(to_messages(row)) + "\n")
    tmp.replace(path)
    return path
