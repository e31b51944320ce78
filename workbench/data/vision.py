"""Prepare a vision-language run's data before launch: image rows read, checked, split, written.

The image counterpart of :mod:`workbench.data.prepare`, for a model whose config has a vision
config: every source is read by :mod:`workbench.data.images` (every image opened and decoded, so
a bad file fails the launch cell naming its row), split like text rows, and written to
RUN_DIR/data/{train,validation}.jsonl in the normalised shape, each image an absolute path (or a
``data:`` URL for images that came as bytes). The ranks turn rows into tokens and pixels while
batching (:mod:`workbench.train.vision`), with the model's processor. Packing is refused here: a
packed row would mix several images' tokens and grids. :func:`example_tokens` counts a row's
tokens as that processor makes them (each image by its size), for the planner
(:func:`vision_token_stats`) and for refusing a row longer than data.max_length before launch.

    >>> summary = prepare_vision_data(spec, rd.data_dir)  # doctest: +SKIP
    >>> summary.counts
    {'train': 72, 'validation': 8}
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.data.prepare import DataSummary
from workbench.data.split import SplitWriter, assign_split
from workbench.data.stats import TokenStats
from workbench.errors import DatasetError, DataTruncationError
from workbench.spec import RunSpec
from workbench.spec.sections import DataSource

PACKING_REFUSED = ("data.packing is on, but {model} is a vision-language model: packing would mix "
                   "several images in one row; set data.packing: false")


def check_vision_spec(spec: RunSpec) -> None:
    """Refuse what the vision path does not do, in one line naming the fix."""
    if spec.data.packing:
        raise DatasetError(PACKING_REFUSED.format(model=spec.model.id))
    if spec.method.kind == "qlora":
        raise DatasetError(f"method.kind is qlora, but {spec.model.id} is a vision-language model, "
                           "which trains with lora or full for now; set method.kind: lora")


def image_source_path(source: DataSource) -> Path:
    """The file an image source reads: a built-in image set's split, or the path given."""
    if source.path.startswith("builtin:"):
        from workbench.assets.teaching_images import builtin_image_dataset_path

        return builtin_image_dataset_path(source.path, source.split)
    return Path(source.path).expanduser()


def image_examples(source: DataSource) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, example)`` for a source's rows in the normalised image shape, at most
    ``max_rows`` of them."""
    from workbench.data.images import read_image_examples

    fmt = source.format if source.format in ("messages", "llava", "columns") else "auto"
    for n, item in enumerate(
            read_image_examples(image_source_path(source), fmt, source.columns or None)):
        if source.max_rows is not None and n >= source.max_rows:
            return
        yield item


def _storable(example: dict[str, Any]) -> dict[str, Any]:
    """The example as JSON: image bytes become a ``data:`` URL (paths are already absolute)."""
    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p["type"] == "image" and isinstance(p["image"], bytes):
            return {"type": "image",
                    "image": "data:image;base64," + base64.b64encode(p["image"]).decode()}
        return p

    return {"messages": [{**m, "content": [part(p) for p in m["content"]]}
                         for m in example["messages"]]}


def _split_key(row: dict[str, Any]) -> str:
    """The row's content: its text, and each image by its bytes (the teaching set asks the same
    question of many pictures), not its path, so where the data lives moves no row across."""
    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p["type"] == "image" and not p["image"].startswith("data:"):
            digest = hashlib.blake2b(Path(p["image"]).read_bytes(), digest_size=16).hexdigest()
            return {"type": "image", "image": digest}
        return p

    return json.dumps([{**m, "content": [part(p) for p in m["content"]]} for m in row["messages"]],
                      sort_keys=True)


def _tokens(processor: Any, messages: list[dict[str, Any]], sizes: list[tuple[int, int]],
            prompt: bool) -> int:
    from workbench.data.images import image_token_count

    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    # The template writes one placeholder per image; the processor expands it to the image's
    # tokens, as many as its resize, patch and merge rule makes of that size.
    return (len(processor.tokenizer(text)["input_ids"])
            + sum(image_token_count(processor, w, h) - 1 for w, h in sizes))


def _placeholders(example: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[int, int]],
                                                  list[int]]:
    """(messages with image placeholders, each image's (width, height), images in the turns up
    to each turn); the sizes read from the files' headers, the pixels left undecoded."""
    from workbench.data.images import open_image

    messages: list[dict[str, Any]] = []
    sizes: list[tuple[int, int]] = []
    seen: list[int] = []
    for turn in example["messages"]:
        parts = []
        for p in turn["content"]:
            if p["type"] == "image":
                with open_image(p["image"]) as img:
                    sizes.append(img.size)
                parts.append({"type": "image"})
            else:
                parts.append(p)
        messages.append({"role": turn["role"], "content": parts})
        seen.append(len(sizes))
    return messages, sizes, seen


def row_tokens(processor: Any, example: dict[str, Any]) -> int:
    """All the tokens of a normalised image example as the processor makes them."""
    messages, sizes, _ = _placeholders(example)
    return _tokens(processor, messages, sizes, prompt=False)


def example_tokens(processor: Any, example: dict[str, Any]) -> tuple[int, int, int]:
    """(tokens before the first trained one, trained tokens, all tokens) of a normalised image
    example as the processor makes it, images counted from their sizes."""
    messages, sizes, seen = _placeholders(example)
    first, trained = None, 0
    for i, turn in enumerate(messages):
        if turn["role"] == "assistant":  # the collator's labels: each assistant turn's tokens
            start = _tokens(processor, messages[:i], sizes[:seen[i]], prompt=True)
            trained += _tokens(processor, messages[:i + 1], sizes[:seen[i]], False) - start
            first = start if first is None else first
    total = _tokens(processor, messages, sizes, prompt=False)
    return (total if first is None else first), trained, total


def vision_token_stats(spec: RunSpec, processor: Any, max_rows: int | None = None) -> TokenStats:
    """Token statistics of ``spec``'s image rows (each source's first ``max_rows``), split as
    :func:`prepare_vision_data` splits them, lengths as :func:`example_tokens` counts them; a row
    over max_length counts as truncated (launch refuses it)."""
    from workbench.data.stats import SplitStats, TokenStats
    from workbench.data.tokenize import IGNORE, Encoded

    splits = {"train": SplitStats(), "validation": SplitStats()}
    L = spec.data.max_length
    for source in spec.data.sources:
        for n, (_where, example) in enumerate(image_examples(source)):
            if max_rows is not None and n >= max_rows:
                break
            side = assign_split(_split_key(_storable(example)), spec.data.validation_fraction,
                                spec.train.seed)
            prompt, trained, total = example_tokens(processor, example)
            kept = min(total, L)
            splits[side].add(Encoded(input_ids=[0] * kept, truncated=total > L,
                                     labels=[IGNORE] * (kept - trained) + [0] * min(trained, kept),
                                     prompt_tokens=prompt, response_tokens=total - prompt))
    return TokenStats(splits=splits, max_length=L, truncation=spec.data.truncation, packing=False)


def spec_processor(spec: RunSpec, folder: str | Path) -> Any:
    """The processor of ``spec``'s model (in ``folder``), with the spec's image pixel bounds."""
    from workbench.data.images import load_processor

    return load_processor(folder, min_pixels=spec.data.image_min_pixels,
                          max_pixels=spec.data.image_max_pixels)


def _local_processor(spec: RunSpec) -> Any:
    """The run's processor when its model is a folder here (built-in or local); None for a hub
    id, whose processor the ranks load."""
    from workbench.spec.models import resolve_model

    source = resolve_model(spec.model.id)
    return spec_processor(spec, source) if Path(source).is_dir() else None


def prepare_vision_data(spec: RunSpec, out_dir: str | Path) -> DataSummary:
    """Write ``out_dir``/{train,validation}.jsonl and summary.json from ``spec``'s image sources.
    A row longer than data.max_length with its image tokens is refused: cutting it would cut an
    image's tokens apart from its pixels."""
    check_vision_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = _local_processor(spec)
    L = spec.data.max_length
    with SplitWriter(out, spec.data.validation_fraction, spec.train.seed) as writer:
        for source in spec.data.sources:
            n = 0
            for where, example in image_examples(source):
                total = row_tokens(processor, example) if processor is not None else 0
                if total > L:
                    raise DataTruncationError(
                        f"{where}: the row is {total} tokens with its images, over data.max_length "
                        f"{L}, and an image row cannot be cut; set data.max_length: {total} or "
                        "more, or use smaller images")
                row = _storable(example)
                writer.write(_split_key(row), row)
                n += 1
            writer.end_source(source.path, n)
    summary = DataSummary(counts=writer.counts, per_source=writer.per_source,
                          preview=writer.preview)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1), encoding="utf-8")
    return summary
