"""Training a vision-language model: the rows, the model and the batches of an image run.

run.py takes this module in place of the text path when the model's config has a vision config
(:func:`workbench.spec.models.is_vision_model`), as it takes workbench.train.preference for a
preference stage, through the same functions: ``load_rows``, ``arguments``, ``trainer_base``,
``trainer_kwargs``, plus ``load_processor`` and ``load_model``. The rows are the normalised image
messages :mod:`workbench.data.vision` wrote; :class:`VisionCollator` turns them into tokens and
pixels with the model's processor while batching (``input_ids``, ``attention_mask``, ``labels``
with only the assistant's tokens trained, ``mm_token_type_ids``, ``pixel_values``,
``image_grid_thw``). LoRA adapts the
language model's attention unless ``method.target_modules`` names modules; the vision tower
stays frozen.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from workbench.runs.rundir import RunDir
from workbench.spec import RunSpec

IGNORE = -100  # the label the loss skips


def load_rows(rd: RunDir, split: str) -> list[dict[str, Any]]:
    """A split's image rows, as written (a list: Arrow would merge text and image parts' keys)."""
    path = rd.data_dir / f"{split}.jsonl"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print(f"data: {split} read {len(rows)} image rows from {path}", flush=True)
    return rows


def arguments(spec: RunSpec, rd: RunDir, has_eval: bool,
              training_arguments: Callable[..., Any]) -> Any:
    return training_arguments(spec, rd, has_eval=has_eval)


def trainer_base(spec: RunSpec) -> None:
    return None  # the plain Trainer: the collator does what TRL's vision path would


def load_processor(spec: RunSpec, source: str) -> Any:
    from workbench.data.vision import spec_processor

    processor = spec_processor(spec, source)
    processor.tokenizer.padding_side = "right"  # the collator pads itself; labels line up
    return processor


def trainer_kwargs(spec: RunSpec, processor: Any, source: str, rd: RunDir) -> dict[str, Any]:
    return {"data_collator": VisionCollator(processor)}


def lora_targets(spec: RunSpec) -> Any:
    """The default ("all-linear") adapts the language model's attention only: the vision tower's
    linears stay out, so the image features the model was trained on are kept."""
    from workbench.assets.tiny_vlm import LANGUAGE_ATTENTION

    targets = spec.method.target_modules
    return LANGUAGE_ATTENTION if targets == "all-linear" else targets


def load_model(spec: RunSpec, source: str, precision: Any = None) -> Any:
    """The VLM (peft-wrapped for LoRA), in the dtype :mod:`workbench.spec.precision` chose."""
    import torch
    from transformers import AutoModelForImageTextToText

    from workbench.spec.precision import local_device_kind, resolve_precision

    p = precision or resolve_precision(spec.model.dtype, spec.method.kind, local_device_kind())
    print(f"precision: load {p.load_dtype}, amp {p.amp}: {p.reason}", flush=True)
    model: Any = AutoModelForImageTextToText.from_pretrained(
        source, revision=spec.model.revision, trust_remote_code=spec.model.trust_remote_code,
        dtype=getattr(torch, p.load_dtype))
    if spec.method.kind == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=spec.method.lora_r, lora_alpha=spec.method.lora_alpha,
                          lora_dropout=spec.method.lora_dropout,
                          target_modules=lora_targets(spec), task_type="CAUSAL_LM")
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    return model


class VisionCollator:
    """Image rows to a padded batch: tokens with each image's placeholder expanded, labels that
    train only the assistant's turns, and the images' patches and grids, concatenated."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.pad_id = processor.tokenizer.pad_token_id

    def _ids(self, messages: list[dict[str, Any]], images: list[Any], prompt: bool) -> Any:
        from workbench.data.images import encode

        return encode(self.processor, [messages], [images], prompt)

    def example(self, row: dict[str, Any]) -> dict[str, Any]:
        import torch

        from workbench.data.images import split_images

        messages, images = split_images(row)
        full = self._ids(messages, images, prompt=False)
        ids = full["input_ids"][0]
        labels = torch.full_like(ids, IGNORE)
        seen = 0  # images in the turns so far: a prefix is processed with its own images
        for i, turn in enumerate(messages):
            seen += sum(p.get("type") == "image" for p in turn["content"])
            if turn["role"] != "assistant":
                continue
            start = self._ids(messages[:i], images[:seen], prompt=True)["input_ids"].shape[1]
            end = self._ids(messages[:i + 1], images[:seen], prompt=False)["input_ids"].shape[1]
            labels[start:end] = ids[start:end]
        out = {"input_ids": ids, "labels": labels}
        if "mm_token_type_ids" in full:
            out["mm_token_type_ids"] = full["mm_token_type_ids"][0]
        for key in ("pixel_values", "image_grid_thw"):
            if key in full:
                out[key] = full[key]
        return out

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        examples = [self.example(r) for r in rows]
        longest = max(len(e["input_ids"]) for e in examples)
        batch: dict[str, Any] = {
            "input_ids": torch.full((len(examples), longest), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(examples), longest), dtype=torch.long),
            "labels": torch.full((len(examples), longest), IGNORE, dtype=torch.long),
        }
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            batch["input_ids"][i, :n] = e["input_ids"]
            batch["attention_mask"][i, :n] = 1
            batch["labels"][i, :n] = e["labels"]
        if any("mm_token_type_ids" in e for e in examples):
            kinds = batch["mm_token_type_ids"] = torch.zeros((len(examples), longest),
                                                             dtype=torch.long)
            for i, e in enumerate(examples):
                if "mm_token_type_ids" in e:
                    kinds[i, :len(e["input_ids"])] = e["mm_token_type_ids"]
        for key in ("pixel_values", "image_grid_thw"):
            parts = [e[key] for e in examples if key in e]
            if parts:
                batch[key] = torch.cat(parts)
        return batch
