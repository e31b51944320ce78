"""Held-out image questions: a vision-language model's weights as a source, and its examples.

The image counterpart of the text path of :mod:`workbench.evaluate.sources` and
:mod:`workbench.evaluate.heldout`: :func:`open_vision` loads a VLM (a base id or folder, or a
run's adapter on its base) with its processor as a :class:`VisionSource`, which answers image
prompts greedily, tokens and pixels made by the processor as training makes them
(:func:`workbench.data.images.encode`); :func:`load_examples` reads a file in any layout
:mod:`workbench.data.images` reads (every image checked) as (prompt, reference) pairs. The
answers are scored as text ones are (``heldout.scores``); each per-example row keeps its
``images`` (a path, or a ``data:`` URL for images that came as bytes) for an answers view.
``builtin:teaching-images`` as the file is the built-in set's ``heldout`` split.

    >>> source = open_vision("builtin:tiny-qwen2-vl", label="base")         # doctest: +SKIP
    >>> source.generate(load_examples("builtin:teaching-images", 2)[0][:1])  # doctest: +SKIP
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import EvalTaskError
from workbench.evaluate.sources import TransformersSource, locate_weights

Messages = list[dict[str, Any]]


def is_vision(source: str | Path) -> bool:
    """Whether a model id/folder, or the base of a run's adapter, reads images."""
    from workbench.spec.models import is_vision_model

    return is_vision_model(locate_weights(source).base)


def open_vision(source: str | Path, label: str = "run") -> VisionSource:
    """A VLM's weights (a base id/folder, a run's adapter/ or model/) with the base's processor,
    its image processor the one the run saved (the run's pixel bounds) where there is one."""
    from transformers import AutoModelForImageTextToText

    from workbench.data.images import load_processor

    where = locate_weights(source)
    model: Any = AutoModelForImageTextToText.from_pretrained(where.base)
    if where.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(where.adapter))
    return VisionSource(model, load_processor(where.base, saved=where.tokenizer), label,
                        where.base_id)


class VisionSource(TransformersSource):
    """VLM weights in this process; prompts are messages with image parts (absolute paths or
    bytes, as :mod:`workbench.data.images` normalises them)."""

    kind = "vision"

    def __init__(self, model: Any, processor: Any, label: str = "run",
                 base_id: str | None = None, batch_size: int = 16) -> None:
        super().__init__(model, processor.tokenizer, label, base_id, batch_size)
        self.processor = processor

    def _encode(self, prompts: Sequence[Messages]) -> Any:
        """Tokens and pixels of a batch of image prompts, as training makes them."""
        from workbench.data.images import encode, split_images

        pairs = [split_images({"messages": m}) for m in prompts]
        return encode(self.processor, [m for m, _ in pairs], [im for _, im in pairs], prompt=True)

    def _open_base(self) -> VisionSource | None:
        return open_vision(self.base_id, label="base") if self.base_id else None


def load_examples(path: str | Path, max_samples: int | None) -> list[tuple[Messages, str]]:
    """(prompt messages, reference) pairs of an image file: the last assistant turn's text is
    the reference, what comes before it the prompt."""
    from workbench.data.images import read_image_examples
    from workbench.errors import DatasetError
    from workbench.evaluate.heldout import prompt_answer_pairs

    if str(path).startswith("builtin:"):
        from workbench.assets.teaching_images import builtin_image_dataset_path

        try:
            path = builtin_image_dataset_path(str(path), split="heldout")
        except DatasetError as exc:
            raise EvalTaskError(str(exc)) from None
    if not Path(path).is_file():
        raise EvalTaskError(f"eval file {path} does not exist; give a jsonl file of image "
                            "questions and answers (messages, llava or columns layout), or "
                            "builtin:teaching-images for the built-in held-out pictures")
    return prompt_answer_pairs(path, (ex["messages"] for _, ex in read_image_examples(path)),
                               max_samples)


def describe(messages: Messages) -> dict[str, Any]:
    """A per-example row's prompt fields: the last turn's text and every image the prompt shows
    (a path, or a ``data:`` URL for bytes)."""
    content = messages[-1]["content"] if messages else ""
    if isinstance(content, str):
        return {"prompt": content}
    text = " ".join(p["text"] for p in content if p["type"] == "text")
    images = [p["image"] if isinstance(p["image"], str)
              else "data:image;base64," + base64.b64encode(p["image"]).decode()
              for m in messages if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    return {"prompt": text, "images": images}
