"""Read image-and-text rows into one shape, check every image opens, and count image tokens.

Three layouts people have, all normalised to ``{"messages": [{"role", "content": [part, ...]}]}``
where a part is ``{"type": "text", "text": str}`` or ``{"type": "image", "image": str | bytes}``
(an absolute path, or the encoded file's bytes; either opens with ``PIL.Image.open``):

  messages  TRL / OpenAI turns whose content mixes text and image parts: ``{"type": "image",
            "image": REF}``, ``{"type": "image_url", "image_url": {"url": REF}}``, or TRL's
            ``{"type": "image"}`` placeholders filled in order from the row's ``images`` list
  llava     ``{"image": REF, "conversations": [{"from": "human", "value": "<image>\\nQ"}, ...]}``;
            each ``<image>`` takes the next image (none: the images open the first turn)
  columns   a csv / parquet / jsonl table with an image column and question / answer columns,
            named by a mapping ``{"image": COL, "prompt": COL, "response": COL, "system": COL}``

A REF is a path (absolute, or relative to the dataset file's folder), a ``file://`` or ``data:``
URL, raw bytes, or a parquet image struct ``{"bytes", "path"}``. Every image is opened and decoded
while reading: a missing, truncated or non-image file raises :class:`ImageDataError` naming the row
and the file; no row is dropped silently.

    >>> from workbench.assets.teaching_images import builtin_image_dataset_path
    >>> where, example = next(read_image_examples(builtin_image_dataset_path(split="train")))
    >>> where, [part["type"] for part in example["messages"][0]["content"]]
    ('line 1 of train.jsonl', ['image', 'text'])
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.data.formats import suggest_columns, to_example
from workbench.errors import DatasetError, DatasetFormatError, ImageDataError

IMAGE_FORMATS = ("auto", "messages", "llava", "columns")
IMAGE_TOKEN = "<image>"  # LLaVA's mark of where an image goes in a turn
_IMAGE_COLUMNS = ("image", "images", "image_path", "img", "picture", "file", "path")


def read_image_examples(path: str | Path, fmt: str = "auto",
                        columns: dict[str, str] | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, example)`` for each row of an image dataset file (jsonl, json, csv, parquet),
    every image checked; relative image paths are read from the file's folder."""
    from workbench.data.sources import read_rows
    from workbench.spec.sections import DataSource

    path = Path(os.path.expanduser(str(path)))
    base = path.parent.resolve()
    for where, row in read_rows(DataSource(path=str(path))):
        yield where, to_image_example(row, fmt, where, base, columns)


def to_image_example(row: dict[str, Any], fmt: str, where: str, base: Path,
                     columns: dict[str, str] | None = None) -> dict[str, Any]:
    """One row in the normalised shape (see the module's docstring)."""
    if fmt == "auto":
        fmt = detect_image_format(row, where, columns)
    if fmt == "messages":
        return {"messages": _messages(row, where, base)}
    if fmt == "llava":
        return {"messages": _llava(row, where, base)}
    if fmt == "columns":
        return {"messages": _columns(row, where, base, columns or _guess_columns(row, where))}
    raise DatasetFormatError(f"{where}: unknown image format {fmt!r}; use one of "
                             f"{', '.join(IMAGE_FORMATS)}")


def detect_image_format(row: dict[str, Any], where: str,
                        columns: dict[str, str] | None = None) -> str:
    if columns:
        return "columns"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "llava"
    if any(c in row for c in _IMAGE_COLUMNS):
        return "columns"
    raise DatasetFormatError(
        f"{where}: cannot tell the image format from its columns {sorted(row)}; expected messages "
        "with image parts, LLaVA's image + conversations, or name the columns, e.g. "
        "{image: COL, prompt: COL, response: COL}")


# -- the three layouts -------------------------------------------------------------------------


def _messages(row: dict[str, Any], where: str, base: Path) -> list[dict[str, Any]]:
    turns = row.get("messages")
    if not isinstance(turns, list):
        raise DatasetFormatError(f'{where}: "messages" must be a list of {{role, content}}')
    pending = list(_as_list(row.get("images")))  # TRL's placeholders take these in order
    n_images = len(pending)
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DatasetFormatError(f'{where}: messages[{i}] must be an object with "role" and '
                                     '"content"')
        if turn["role"] not in ("system", "user", "assistant"):
            raise DatasetFormatError(f"{where}: messages[{i}] has role {turn['role']!r}; use "
                                     "system, user or assistant")
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise DatasetFormatError(f"{where}: messages[{i}].content must be a string or a list "
                                     "of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text") or "")})
            elif kind in ("image", "image_url"):
                ref = _part_ref(part)
                if ref is None:
                    if not pending:
                        raise ImageDataError(
                            f"{where}: messages[{i}].content[{j}] is an image with no file and the "
                            f"row's images list has only {n_images}; add the image to the part "
                            "or to the row's images")
                    ref = pending.pop(0)
                parts.append(_image_part(ref, where, base))
            else:
                raise DatasetFormatError(f"{where}: messages[{i}].content[{j}] must be a text or "
                                         f"image part, got {part!r:.80}")
        out.append({"role": str(turn["role"]), "content": parts})
    if pending:
        raise ImageDataError(f"{where}: the row lists {n_images} images but its messages use "
                             f"{n_images - len(pending)}; add an image part for each, or remove "
                             "the extra images")
    return _checked(out, where)


def _part_ref(part: dict[str, Any]) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def _llava(row: dict[str, Any], where: str, base: Path) -> list[dict[str, Any]]:
    images = list(_as_list(row.get("image", row.get("images"))))
    turns = to_example({"conversations": row.get("conversations")}, "sharegpt", where)["messages"]
    marks = sum(t["content"].count(IMAGE_TOKEN) for t in turns)
    if marks and marks != len(images):
        raise ImageDataError(f"{where}: the conversation has {marks} {IMAGE_TOKEN} mark(s) but the "
                             f"row names {len(images)} image(s); make them match")
    pending = [_image_part(ref, where, base) for ref in images]
    out = []
    for turn in turns:
        parts: list[dict[str, Any]] = []
        if not marks and pending and turn["role"] == "user":  # no marks: images open the prompt
            parts, pending = pending, []
        pieces = turn["content"].split(IMAGE_TOKEN)
        for k, piece in enumerate(pieces):
            if k:
                parts.append(pending.pop(0))
            text = piece.strip("\n") if len(pieces) > 1 else piece
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": turn["role"], "content": parts})
    return _checked(out, where)


def _guess_columns(row: dict[str, Any], where: str) -> dict[str, str]:
    image = next((c for c in _IMAGE_COLUMNS if c in row), None)
    guess = suggest_columns({k: v for k, v in row.items() if k != image})
    if image is None or not guess:
        raise DatasetFormatError(
            f"{where}: name the image, question and answer columns, e.g. columns: {{image: COL, "
            f"prompt: COL, response: COL}}; its columns are {sorted(row)}")
    return {"image": image, **guess}


def _columns(row: dict[str, Any], where: str, base: Path,
             columns: dict[str, str]) -> list[dict[str, Any]]:
    missing = [c for c in columns.values() if c not in row]
    if missing or "image" not in columns or "prompt" not in columns or "response" not in columns:
        raise DatasetFormatError(
            f"{where}: the columns mapping {columns} needs image, prompt and response, each a "
            f"column of the file; missing {missing or 'a part'}, its columns are {sorted(row)}")
    out: list[dict[str, Any]] = []
    if columns.get("system") and row[columns["system"]]:
        out.append({"role": "system",
                    "content": [{"type": "text", "text": str(row[columns["system"]])}]})
    images = [_image_part(ref, where, base) for ref in _as_list(row[columns["image"]])]
    out.append({"role": "user",
                "content": images + [{"type": "text", "text": str(row[columns["prompt"]])}]})
    out.append({"role": "assistant",
                "content": [{"type": "text", "text": str(row[columns["response"]])}]})
    return _checked(out, where)


def _checked(msgs: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    if not any(m["role"] == "assistant" and any(p["type"] == "text" for p in m["content"])
               for m in msgs):
        raise DatasetFormatError(f"{where}: the conversation has no assistant text, so there is "
                                 "nothing to learn; add the answer")
    return msgs


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str) and value.startswith("["):  # a csv cell holding a JSON list
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return [value]
        return parsed if isinstance(parsed, list) else [value]
    return [value]


# -- images ------------------------------------------------------------------------------------


def _image_part(ref: Any, where: str, base: Path) -> dict[str, Any]:
    image = resolve_image(ref, where, base)
    check_image(image, where)
    return {"type": "image", "image": image}


def resolve_image(ref: Any, where: str, base: Path) -> str | bytes:
    """An absolute path or the file's bytes for an image reference (see the module docstring)."""
    if isinstance(ref, dict):  # a parquet / datasets image struct
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, bytes | bytearray | memoryview):
        return bytes(ref)
    if not isinstance(ref, str) or not ref.strip():
        raise ImageDataError(f"{where}: the image {ref!r:.60} is neither a path, a URL nor bytes; "
                             "give a file path (relative to the dataset's folder) or a data: URL")
    if ref.startswith("data:"):
        try:
            return base64.b64decode(ref.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error):
            raise ImageDataError(f"{where}: the image's data: URL is not base64 "
                                 "(data:image/png;base64,...); re-encode it") from None
    if ref.startswith(("http://", "https://")):
        raise ImageDataError(f"{where}: the image {ref} is a web address, which training does not "
                             "fetch; download the images and name the files instead")
    path = Path(os.path.expanduser(ref.removeprefix("file://")))
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ImageDataError(f"{where}: image file {path} not found; put it there or fix the "
                             f"path (relative paths are read from {base})")
    return str(path)


def check_image(image: str | bytes, where: str) -> tuple[int, int]:
    """Decode the image fully (a truncated file fails here, not in training); its (width, height)."""
    from PIL import Image, UnidentifiedImageError

    name = image if isinstance(image, str) else f"the row's image bytes ({len(image)} bytes)"
    try:
        with open_image(image) as img:
            img.load()
            return img.size
    except UnidentifiedImageError:
        reason = "not an image file"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise ImageDataError(f"{where}: {name} is not a readable image ({reason}); replace the file "
                         "with a valid PNG or JPEG, or remove the row")


def open_image(image: str | bytes) -> Any:
    """``PIL.Image.open`` on a normalised image (a path or the file's bytes)."""
    from PIL import Image

    return Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)


def split_images(example: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(messages, images)`` as processors and TRL's vision collator take them: image parts
    become ``{"type": "image"}`` placeholders and ``images`` the opened RGB images, in order."""
    images, messages = [], []
    for turn in example["messages"]:
        parts = []
        for part in turn["content"]:
            if part["type"] == "image":
                images.append(open_image(part["image"]).convert("RGB"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({"role": turn["role"], "content": parts})
    return messages, images


# -- the processor -----------------------------------------------------------------------------


def encode(processor: Any, conversations: list[list[dict[str, Any]]], images: list[list[Any]],
           prompt: bool) -> Any:
    """Tokens and pixels of conversations (each as :func:`split_images` gives it, with its
    images) through the processor's chat template, padded on the tokenizer's side; ``prompt``
    adds the assistant's opening, as generation wants. Training and evaluation both batch so."""
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=prompt)
             for m in conversations]
    flat = [image for some in images for image in some]
    # mm_token_type_ids marks the image tokens: Qwen2-VL's 3-D positions (M-RoPE) need them.
    return processor(text=texts, images=flat or None, return_tensors="pt", padding=True,
                     return_mm_token_type_ids=bool(flat))


def load_processor(model_path: str | Path, *, min_pixels: int | None = None,
                   max_pixels: int | None = None, saved: str | Path | None = None) -> Any:
    """The model's processor; ``min_pixels`` / ``max_pixels`` bound the pixels each image is
    resized to (the spec's ``data.image_min_pixels`` / ``image_max_pixels``); ``saved``, a
    folder a run saved its processor into, gives the image processor the run trained with.

    Without torchvision (which video processors need) transformers cannot build a Qwen2-VL
    processor, so this builds it from the tokenizer and the image processor alone: images work,
    videos are refused."""
    import importlib.util

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
    if saved is not None and (Path(saved) / "preprocessor_config.json").is_file():
        image_processor = AutoImageProcessor.from_pretrained(saved, **bounds)
    else:
        image_processor = AutoImageProcessor.from_pretrained(model_path, **bounds)
    _check_bounds(image_processor, bounds, model_path)
    if importlib.util.find_spec("torchvision") is not None:
        processor = AutoProcessor.from_pretrained(model_path)
        processor.image_processor = image_processor
        return processor
    import transformers
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_path).model_type
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    base = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

        def save_pretrained(self, save_directory: Any, **kwargs: Any) -> list[str]:
            # The base saves every attribute, the missing video processor too; the tokenizer
            # (chat template included) and the image processor are what loading it back needs.
            return [*self.tokenizer.save_pretrained(save_directory, **kwargs),
                    *self.image_processor.save_pretrained(save_directory, **kwargs)]

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=None, chat_template=tokenizer.chat_template)


def _check_bounds(image_processor: Any, bounds: dict[str, int], model: str | Path) -> None:
    """Pixel bounds apply to processors that resize each image to a pixel budget (Qwen2-VL and
    its kin keep them as the size's shortest_edge / longest_edge); any other sizes images its
    own way, and the bounds would be silently ignored: refused."""
    size = dict(getattr(image_processor, "size", None) or {})
    held = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    if any(held[k] != v for k, v in bounds.items()):
        raise DatasetError(f"data.image_min_pixels / image_max_pixels: {Path(str(model)).name}'s "
                           f"image processor ({type(image_processor).__name__}) sizes images its "
                           "own way, not to a pixel budget; remove them from the spec")
    if held["min_pixels"] and held["max_pixels"] and held["min_pixels"] > held["max_pixels"]:
        raise DatasetError(f"data.image_min_pixels ({held['min_pixels']}) is above "
                           f"image_max_pixels ({held['max_pixels']}); lower the first or raise "
                           "the second")


def image_token_count(processor: Any, width: int, height: int) -> int:
    """How many tokens the processor turns an image of this size into (after its resizing)."""
    counts = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
    return int(counts.num_image_tokens[0])
