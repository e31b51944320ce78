"""Held-out image questions scored like text ones: the built-in tiny Qwen2-VL before and after a
real 2-process LoRA run, on the built-in set's held-out pictures, and a text model refused them.

How it tests: the base model's answers through ``workbench.evaluate.runner.evaluate`` (batched,
left-padded) are compared with answers generated here one picture at a time, straight from
transformers' model and the processor's chat template (the oracle: no Workbench code between
the file's rows and ``model.generate`` but the processor loader). The file is in LLaVA's layout,
so the reader is not the one the built-in set's messages take. The tuned model is a real run
(``workbench.launch``, 2 processes) scored by ``job.evaluate``; its exact match is compared with
the base's on the same 56 pictures, and the per-example rows on disk are checked to name each
picture. The refusal is a real evaluation of the tiny text model on image rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench
from workbench.assets.teaching_images import builtin_image_dataset_path, image_teaching_rows
from workbench.errors import EvalTaskError
from workbench.evaluate import results
from workbench.evaluate.runner import evaluate
from workbench.widgets.answers import answers_html, example_answers

VLM = "builtin:tiny-qwen2-vl"
HELDOUT = len(list(image_teaching_rows("heldout")))  # 56 questions on 44 pictures
# Settings with which the tuned model answers the held-out pictures well (docs/vision.md).
TRAIN = {"epochs": 20, "lr": 3e-3}


def _llava_file(folder: Path, n: int) -> tuple[Path, list[dict]]:
    """The first ``n`` held-out questions as LLaVA rows naming the built-in PNGs by path."""
    pictures = builtin_image_dataset_path(split="heldout").parent / "images"
    rows = list(image_teaching_rows("heldout"))[:n]
    path = folder / "llava.jsonl"
    path.write_text("".join(json.dumps({
        "image": str(pictures / r["image"]),
        "conversations": [{"from": "human", "value": f"<image>\n{r['question']}"},
                          {"from": "gpt", "value": r["answer"]}]}) + "\n" for r in rows))
    return path, rows


def _direct_answers(rows: list[dict], pictures: Path, max_new_tokens: int) -> list[str]:
    """Greedy answers of the base VLM, one picture at a time, with transformers alone."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from workbench.data.images import load_processor
    from workbench.spec.models import resolve_model

    path = resolve_model(VLM)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_processor(path)
    out = []
    for r in rows:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": r["question"]}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        image = Image.open(pictures / r["image"]).convert("RGB")
        enc = processor(text=[text], images=[image], return_tensors="pt",
                        return_mm_token_type_ids=True)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=processor.tokenizer.pad_token_id)
        out.append(processor.tokenizer.decode(gen[0, enc["input_ids"].shape[1]:],
                                              skip_special_tokens=True).strip())
    return out


def test_the_base_vlm_answers_image_rows_as_transformers_does_one_by_one(tmp_path):
    file, rows = _llava_file(tmp_path, 12)
    report = evaluate(VLM, tasks=["heldout"], file=file, max_new_tokens=6, label="base")
    got = report.examples["heldout"]
    pictures = builtin_image_dataset_path(split="heldout").parent / "images"
    assert [g["prediction"] for g in got] == _direct_answers(rows, pictures, 6)
    assert [g["reference"] for g in got] == [r["answer"] for r in rows]
    assert [g["prompt"] for g in got] == [r["question"] for r in rows]
    assert [g["images"] for g in got] == [[str(pictures / r["image"])] for r in rows]
    # A random-weight model says none of the answers.
    assert report.metrics["heldout.exact_match"] == 0.0


def test_a_text_model_given_image_rows_is_refused_in_one_line(tmp_path):
    file, _ = _llava_file(tmp_path, 2)
    with pytest.raises(EvalTaskError) as info:
        evaluate("builtin:tiny-llama", tasks=["heldout"], file=file)
    message = str(info.value)
    assert "\n" not in message, message
    assert "line 1 of llava.jsonl holds an image" in message, message
    assert "evaluate a vision-language model (builtin:tiny-qwen2-vl" in message, message


@pytest.mark.slow
def test_a_tuned_vlm_answers_held_out_pictures_the_base_cannot(tmp_path):
    spec = {"name": "vision-eval", "model": {"id": VLM},
            "data": {"sources": [{"path": "builtin:teaching-images"}]},
            "train": TRAIN, "eval": {"after": False}, "resources": {"processes_per_node": 2}}
    job = workbench.launch(spec)
    assert job.wait(timeout=300, progress=False) == "succeeded", job.logs(tail=20)
    tuned = job.evaluate(["heldout"], file="builtin:teaching-images", max_new_tokens=8)
    base = evaluate(VLM, tasks=["heldout"], file="builtin:teaching-images", max_new_tokens=8,
                    label="base", run_dir=job.run_dir.path, phase="manual", step=0)
    assert len(tuned.examples["heldout"]) == len(base.examples["heldout"]) == HELDOUT
    before = base.metrics["heldout.exact_match"]
    after = tuned.metrics["heldout.exact_match"]
    # The three kinds of question have 3 or 4 answers each: guessing the right kind of word
    # scores about 0.27; the tuned model reads the pictures well past that.
    assert before == 0.0 and after >= 0.4, (before, after)
    # The line is the run's; its per-example rows on disk name each picture, which exists.
    line = next(ln for ln in results.read(job.run_dir.path) if ln["model"] == "run")
    assert (line["phase"], line["task"], line["n"]) == ("manual", "heldout", HELDOUT)
    rows = [json.loads(r) for r in (job.run_dir.path / line["examples"]).read_text().splitlines()]
    assert len(rows) == HELDOUT and all(Path(r["images"][0]).is_file() for r in rows)
    assert sum(r["exact_match"] for r in rows) / HELDOUT == pytest.approx(after)
    # The answers view: one row per question and picture (the same question is asked of many
    # pictures), the picture drawn beside the base's and the run's answers.
    df = example_answers([job], "heldout")
    assert list(df.columns) == ["image", "prompt", "reference", "base", job.id]
    assert len(df) == HELDOUT
    assert [list(df[job.id]), list(df["base"])] == [
        [r["prediction"] for r in rows], [r["prediction"] for r in base.examples["heldout"]]]
    assert answers_html(df).count("<img src='data:image/png;base64,") == HELDOUT
