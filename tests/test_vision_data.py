"""Image rows in the three layouts people have, the image teaching set, and the tiny Qwen2-VL.

Each layout is written here by hand (files on disk, images as real PNGs drawn here) and read back
through ``read_image_examples``; the expected normalised rows are written out literally beside
the file, never produced by the reader. Bad images are real bad files (none, a cut PNG, text named
.png) in the second row, so the error must name that row. The teaching set is checked against
its pixels (colour of the shape, blobs counted by a flood fill written here). The tiny VLM is
built, its real processor makes the input ids, and a real peft LoRA on the decoder's attention
trains 20 steps on teaching rows.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from workbench.assets.teaching_images import (
    COLOURS,
    builtin_image_dataset_path,
    image_teaching_rows,
)
from workbench.assets.tiny_vlm import LANGUAGE_ATTENTION, build_tiny_vlm, builtin_vlm_path
from workbench.data.images import (
    ImageDataError,
    image_token_count,
    load_processor,
    read_image_examples,
    split_images,
)
from workbench.errors import DatasetFormatError


def _png(path: Path, colour: str = "red", size: tuple[int, int] = (20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(image: str | bytes) -> dict:
    return {"type": "image", "image": image}


def _read(path: Path, **kwargs) -> list[tuple[str, dict]]:
    return list(read_image_examples(path, **kwargs))


# -- the three layouts -------------------------------------------------------------------------


def test_messages_rows_with_every_kind_of_image_part(tmp_path):
    """Relative path, absolute path in an image_url, a data: URL, and TRL's placeholders."""
    red = _png(tmp_path / "pics" / "red.png", "red")
    _png(tmp_path / "pics" / "blue.png", "blue")
    blue_abs = str(tmp_path / "pics" / "blue.png")
    data_url = "data:image/png;base64," + base64.b64encode(red).decode()
    path = _jsonl(tmp_path / "train.jsonl", [
        {"messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "image", "image": "pics/red.png"},
                                         {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]},
        {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": blue_abs}},
                                         {"type": "image_url", "image_url": {"url": data_url}},
                                         {"type": "text", "text": "Colours?"}]},
            {"role": "assistant", "content": "blue, red"}]},
        {"images": ["pics/blue.png"], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Which?"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]},
    ])
    assert _read(path) == [
        ("line 1 of train.jsonl", {"messages": [
            {"role": "system", "content": [_text("Answer in one word.")]},
            {"role": "user", "content": [_image(str(tmp_path / "pics" / "red.png")),
                                         _text("Colour?")]},
            {"role": "assistant", "content": [_text("red")]}]}),
        ("line 2 of train.jsonl", {"messages": [
            {"role": "user", "content": [_image(blue_abs), _image(red), _text("Colours?")]},
            {"role": "assistant", "content": [_text("blue, red")]}]}),
        ("line 3 of train.jsonl", {"messages": [
            {"role": "user", "content": [_text("Which?"), _image(blue_abs)]},
            {"role": "assistant", "content": [_text("blue")]}]}),
    ]


def test_llava_rows_put_each_image_where_its_mark_is(tmp_path):
    _png(tmp_path / "a.png", "green")
    _png(tmp_path / "sub" / "b.png", "yellow")
    path = _jsonl(tmp_path / "llava.jsonl", [
        {"id": "1", "image": "a.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is it?"},
            {"from": "gpt", "value": "green"},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "yes"}]},
        {"image": "sub/b.png", "conversations": [  # no mark: the image opens the first turn
            {"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "yellow"}]},
    ])
    a, b = str(tmp_path / "a.png"), str(tmp_path / "sub" / "b.png")
    assert [e for _, e in _read(path)] == [
        {"messages": [{"role": "user", "content": [_image(a), _text("What colour is it?")]},
                      {"role": "assistant", "content": [_text("green")]},
                      {"role": "user", "content": [_text("Sure?")]},
                      {"role": "assistant", "content": [_text("yes")]}]},
        {"messages": [{"role": "user", "content": [_image(b), _text("Describe it.")]},
                      {"role": "assistant", "content": [_text("yellow")]}]},
    ]


def _qa(image: str | bytes, question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [_image(image), _text(question)]},
                         {"role": "assistant", "content": [_text(answer)]}]}


def test_a_csv_of_paths_with_a_column_mapping(tmp_path):
    _png(tmp_path / "img" / "1.png", "red")
    with (tmp_path / "qa.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["picture", "q", "a", "note"])
        w.writerow(["img/1.png", "What colour?", "red", "x"])
        w.writerow([str(tmp_path / "img" / "1.png"), "Again?", "red", "y"])
    rows = _read(tmp_path / "qa.csv",
                 columns={"image": "picture", "prompt": "q", "response": "a"})
    one = str(tmp_path / "img" / "1.png")
    assert rows == [("line 2 of qa.csv", _qa(one, "What colour?", "red")),
                    ("line 3 of qa.csv", _qa(one, "Again?", "red"))]


def test_a_parquet_of_image_bytes_and_datasets_image_structs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    blue = _png(tmp_path / "blue.png", "blue")
    green = _png(tmp_path / "green.png", "green")
    table = pa.table({
        "img": [{"bytes": blue, "path": None}, {"bytes": None, "path": "green.png"}],
        "question": ["Colour?", "And this one?"], "answer": ["blue", "green"]})
    pq.write_table(table, tmp_path / "qa.parquet")
    raw = pa.table({"img": [green], "question": ["Colour?"], "answer": ["green"]})
    pq.write_table(raw, tmp_path / "raw.parquet")
    mapping = {"image": "img", "prompt": "question", "response": "answer"}
    assert _read(tmp_path / "qa.parquet", columns=mapping) == [
        ("row 1 of qa.parquet", _qa(blue, "Colour?", "blue")),
        ("row 2 of qa.parquet", _qa(str(tmp_path / "green.png"), "And this one?", "green"))]
    assert _read(tmp_path / "raw.parquet", columns=mapping) == [
        ("row 1 of raw.parquet", _qa(green, "Colour?", "green"))]


def test_a_jsonl_table_is_read_without_a_mapping_when_its_columns_say_it(tmp_path):
    _png(tmp_path / "x.png")
    path = _jsonl(tmp_path / "t.jsonl", [{"image": "x.png", "question": "Q?", "answer": "A"}])
    assert _read(path) == [("line 1 of t.jsonl", _qa(str(tmp_path / "x.png"), "Q?", "A"))]


# -- bad images ----------------------------------------------------------------------------------

def _missing(path: Path) -> None:
    pass


def _truncated(path: Path) -> None:
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buf, format="PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


def _text_named_png(path: Path) -> None:
    path.write_text("this is a shopping list, not a picture\n")


def _messages_file(folder: Path, bad: str) -> Path:
    return _jsonl(folder / "bad.jsonl", [
        {"messages": [{"role": "user", "content": [_image(name), _text("Q")]},
                      {"role": "assistant", "content": "A"}]} for name in ("good.png", bad)])


def _llava_file(folder: Path, bad: str) -> Path:
    return _jsonl(folder / "bad.jsonl", [
        {"image": name, "conversations": [{"from": "human", "value": "<image>\nQ"},
                                          {"from": "gpt", "value": "A"}]}
        for name in ("good.png", bad)])


def _csv_file(folder: Path, bad: str) -> Path:
    path = folder / "bad.csv"
    path.write_text(f"image,question,answer\ngood.png,Q,A\n{bad},Q,A\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("make_bad, says", [
    (_missing, "not found"), (_truncated, "not a readable image"),
    (_text_named_png, "not a readable image (not an image file)")])
@pytest.mark.parametrize("write, where", [
    (_messages_file, "line 2 of bad.jsonl"), (_llava_file, "line 2 of bad.jsonl"),
    (_csv_file, "line 3 of bad.csv")])
def test_a_bad_image_is_a_one_line_error_naming_the_row_and_the_file(
        tmp_path, make_bad, says, write, where):
    _png(tmp_path / "good.png")
    make_bad(tmp_path / "broken.png")
    rows = read_image_examples(write(tmp_path, "broken.png"))
    next(rows)  # the good first row reads
    with pytest.raises(ImageDataError) as err:
        next(rows)
    message = str(err.value)
    assert isinstance(err.value, DatasetFormatError)
    assert "\n" not in message
    assert message.startswith(f"{where}: ")
    assert str(tmp_path / "broken.png") in message
    assert says in message


@pytest.mark.parametrize("row, error, says", [
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image> and <image>?"},
                                          {"from": "gpt", "value": "A"}]},
     ImageDataError, "2 <image> mark(s) but the row names 1 image(s)"),
    ({"images": [], "messages": [{"role": "user", "content": [{"type": "image"}]},
                                 {"role": "assistant", "content": "A"}]},
     ImageDataError, "image with no file and the row's images list has only 0"),
    ({"images": ["a.png", "a.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "A"}]},
     ImageDataError, "lists 2 images but its messages use 1"),
    ({"messages": [{"role": "human", "content": "Q"}, {"role": "assistant", "content": "A"}]},
     DatasetFormatError, "messages[0] has role 'human'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]},
     DatasetFormatError, "no assistant text"),
    ({"image": "https://example.org/a.png", "question": "Q", "answer": "A"},
     ImageDataError, "web address"),
])
def test_rows_whose_images_and_turns_do_not_fit_are_refused(tmp_path, row, error, says):
    _png(tmp_path / "a.png")
    path = _jsonl(tmp_path / "m.jsonl", [row])
    with pytest.raises(error) as err:
        _read(path)
    assert str(err.value).startswith("line 1 of m.jsonl: ") and says in str(err.value)


# -- the image teaching set ----------------------------------------------------------------------


def _blobs(image: Image.Image) -> list[tuple[tuple[int, int, int], int]]:
    """(mean colour, pixel count) of each 4-connected group of non-white pixels."""
    w, h = image.size
    px = image.convert("RGB").load()
    assert px is not None
    seen: set[tuple[int, int]] = set()
    blobs = []
    for start in ((x, y) for y in range(h) for x in range(w)):
        if start in seen or min(px[start]) > 200:
            continue
        stack, pixels = [start], []
        seen.add(start)
        while stack:
            x, y = stack.pop()
            pixels.append(px[x, y])
            for n in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= n[0] < w and 0 <= n[1] < h and n not in seen and min(px[n]) <= 200:
                    seen.add(n)
                    stack.append(n)
        if len(pixels) > 10:  # anti-aliased specks are not shapes
            mean = tuple(sum(c[i] for c in pixels) // len(pixels) for i in range(3))
            blobs.append((mean, len(pixels)))
    return blobs


def _nearest_colour(rgb: tuple[int, ...]) -> str:
    return min(COLOURS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLOURS[c], rgb)))


def test_the_teaching_images_show_what_their_answers_say():
    train, held = (builtin_image_dataset_path(split=s) for s in ("train", "heldout"))
    assert train.parent == held.parent
    rows = {s: [json.loads(line) for line in p.read_text().splitlines()]
            for s, p in (("train", train), ("heldout", held))}
    assert len(rows["train"]) == 112 and len(rows["heldout"]) == 56
    images = {s: {r["messages"][0]["content"][0]["image"] for r in rows[s]} for s in rows}
    assert not images["train"] & images["heldout"], "a held-out picture is also in training"
    for row in rows["train"] + rows["heldout"]:
        name = row["messages"][0]["content"][0]["image"]
        question = row["messages"][0]["content"][1]["text"]
        answer = row["messages"][1]["content"][0]["text"]
        blobs = _blobs(Image.open(train.parent / name))
        if question.startswith("How many"):
            assert len(blobs) == int(answer), f"{name}: {len(blobs)} shapes, answer {answer}"
        else:
            assert len(blobs) == 1, f"{name}: {len(blobs)} shapes"
            if "colour" in question:
                assert _nearest_colour(blobs[0][0]) == answer, f"{name} is not {answer}"
    # Every fact is in both splits, only the drawing differs.
    facts = {s: {name.rsplit("-", 1)[0] for name in images[s]} for s in images}
    assert facts["train"] == facts["heldout"]


def test_the_teaching_set_reads_as_image_examples_and_is_the_same_every_time():
    examples = _read(builtin_image_dataset_path(split="heldout"))
    assert len(examples) == len(list(image_teaching_rows("heldout")))
    first = examples[0][1]["messages"]
    assert Path(first[0]["content"][0]["image"]).is_file()
    assert [first[0]["content"][1]["text"], first[1]["content"][0]["text"]] == [
        "What colour is the shape?", "red"]
    digest = hashlib.sha256(Path(first[0]["content"][0]["image"]).read_bytes()).hexdigest()
    from workbench.assets.teaching_images import draw_image

    redrawn = io.BytesIO()
    draw_image(Path(first[0]["content"][0]["image"]).stem).save(redrawn, format="PNG")
    assert hashlib.sha256(redrawn.getvalue()).hexdigest() == digest


# -- the tiny vision-language model --------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm() -> Path:
    return builtin_vlm_path()


def test_the_tiny_vlm_is_built_the_same_every_time(vlm, tmp_path):
    build_tiny_vlm(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json",
                 "preprocessor_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (vlm / name).read_bytes(), name


def test_the_processor_turns_a_teaching_row_into_image_tokens(vlm):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm)
    assert config.architectures == ["Qwen2VLForConditionalGeneration"]
    processor = load_processor(vlm)
    _, example = _read(builtin_image_dataset_path(split="train"))[0]
    messages, images = split_images(example)
    text = processor.apply_chat_template(messages, tokenize=False)
    batch = processor(text=[text], images=images, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    n = ids.count(config.image_token_id)
    assert n == image_token_count(processor, *images[0].size) == 9
    # A bigger, oblong picture is shrunk to the processor's pixel cap: the count says so too.
    big = Image.new("RGB", (300, 120), "blue")
    batch = processor(text=[text], images=[big], return_tensors="pt")
    n_big = batch["input_ids"][0].tolist().count(config.image_token_id)
    assert n_big == image_token_count(processor, 300, 120)
    assert 1 <= n_big <= 9
    answer = processor.tokenizer("red", add_special_tokens=False)["input_ids"]
    assert any(ids[i:i + len(answer)] == answer for i in range(len(ids)))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_the_decoders_attention_learns_teaching_rows(vlm):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(vlm)
    processor = load_processor(vlm)
    model = Qwen2VLForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=LANGUAGE_ATTENTION))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model.layers." in n and ".self_attn." in n
                             for n in trainable), trainable
    assert len(trainable) == 2 * 4 * config.text_config.num_hidden_layers  # A and B, q/k/v/o

    rows = [e for _, e in _read(builtin_image_dataset_path(split="train"))][:4]
    pairs = [split_images(e) for e in rows]
    texts = [processor.apply_chat_template(m, tokenize=False) for m, _ in pairs]
    batch = processor(text=texts, images=[i for _, ims in pairs for i in ims], padding=True,
                      return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    labels[labels == config.image_token_id] = -100
    vision_before = model.base_model.model.model.visual.blocks[0].attn.qkv.weight.clone()
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    model.train()
    for _ in range(20):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert torch.equal(model.base_model.model.model.visual.blocks[0].attn.qkv.weight,
                       vision_before), "the vision tower changed"


# -- what the plan counts ------------------------------------------------------------------------


def _wide_vlm(vlm: Path, folder: Path) -> Path:
    """The tiny VLM with a real Qwen2-VL's kind of pixel cap: up to 64 tokens an image (28x28
    pixels each, 14-pixel patches merged 2x2) instead of the built-in's nine."""
    shutil.copytree(vlm, folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = 64 * 28 * 28
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


# (width, height): one token, two, nine, 32 both ways round, and a photo the processor shrinks.
_SIZES = [(28, 28), (56, 28), (84, 84), (224, 112), (112, 224), (640, 480)]


def _sized_rows(folder: Path) -> Path:
    rows = []
    for i, size in enumerate(_SIZES):
        _png(folder / f"{i}.png", "green", size)
        rows.append({"messages": [
            {"role": "user", "content": [_image(f"{i}.png"), _text("What colour is it?")]},
            {"role": "assistant", "content": [_text("green " * (i + 1))]}]})
    return _jsonl(folder / "sized.jsonl", rows)


def _processed(model: Path, path: Path) -> tuple[list[int], list[int]]:
    """Each row's ids as the model's processor really makes them, with its real pixels:
    (lengths, image tokens among them, the model config's image token)."""
    from transformers import AutoConfig

    processor = load_processor(model)
    image_id = AutoConfig.from_pretrained(model).image_token_id
    lengths, image_tokens = [], []
    for _, example in _read(path):
        messages, images = split_images(example)
        ids = processor(text=[processor.apply_chat_template(messages, tokenize=False)],
                        images=images, return_tensors="pt")["input_ids"][0].tolist()
        lengths.append(len(ids))
        image_tokens.append(ids.count(image_id))
    return lengths, image_tokens


def test_the_plan_counts_each_rows_image_tokens_as_the_processor_makes_them(vlm, tmp_path):
    """The oracle is the processor itself: each row is processed with its real pixels and the
    image tokens counted in the ids it makes (trained tokens: the training collator's labels);
    the plan counts from the image sizes and the processor's settings, without the pixels."""
    import workbench
    from workbench.data.vision import example_tokens
    from workbench.spec import RunSpec
    from workbench.train.vision import VisionCollator

    model = _wide_vlm(vlm, tmp_path / "wide-vlm")
    path = _sized_rows(tmp_path)
    processor = load_processor(model)
    lengths, image_tokens = _processed(model, path)
    # Qwen2-VL's rule: one token per 28x28 pixels; the photo is shrunk under the 64-token cap.
    assert image_tokens[:5] == [1, 2, 9, 32, 32] and 32 < image_tokens[5] <= 64, image_tokens
    for (where, example), n in zip(_read(path), lengths, strict=True):
        trained = int((VisionCollator(processor).example(example)["labels"] != -100).sum())
        assert example_tokens(processor, example)[1:] == (trained, n), where

    spec = RunSpec(model={"id": str(model)}, train={"batch_size": 1},
                   resources={"processes_per_node": 1},
                   data={"sources": [{"path": str(path)}], "validation_fraction": 0,
                         "max_length": 512})
    plan = workbench.plan(spec)
    train = plan.data_tokens["splits"]["train"]
    assert train["examples"] == len(_SIZES) and train["truncated"] == 0
    assert (train["tokens"]["min"], train["tokens"]["max"]) == (min(lengths), max(lengths))
    assert plan.memory_seq_len == max(lengths)  # activations sized by the longest, images in it
    # One example a step (batch_size 1, one process): the step's tokens are the rows' average.
    assert plan.tokens_per_step == round(sum(lengths) / len(lengths)), plan.data_note


def test_an_image_row_longer_than_max_length_is_refused_naming_the_length_it_needs(
        vlm, tmp_path):
    """max_length is set between the longest row and the next (lengths from the processor): the
    longest row is refused by its line, and the max_length the message names prepares it."""
    from workbench.data.vision import prepare_vision_data
    from workbench.errors import DataTruncationError
    from workbench.spec import RunSpec

    model = _wide_vlm(vlm, tmp_path / "wide-vlm")
    path = _sized_rows(tmp_path)
    lengths, _ = _processed(model, path)
    longest = max(lengths)
    data = {"sources": [{"path": str(path)}], "validation_fraction": 0}
    short = RunSpec(model={"id": str(model)}, data={**data, "max_length": longest - 1})
    assert sorted(lengths)[-2] < longest, lengths  # one row alone over the limit
    with pytest.raises(DataTruncationError) as err:
        prepare_vision_data(short, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"line {lengths.index(longest) + 1} of sized.jsonl: "), message
    assert f"data.max_length: {longest} or more" in message, message
    enough = RunSpec(model={"id": str(model)}, data={**data, "max_length": longest})
    assert prepare_vision_data(enough, tmp_path / "out").counts["train"] == len(_SIZES)


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                               {"type": "text", "text": "Colour?"}]},
                  {"role": "assistant", "content": "red"}]},
    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nColour?"},
                                         {"from": "gpt", "value": "red"}]},
    {"images": ["a.png"], "messages": [{"role": "user", "content": "Colour?"},
                                       {"role": "assistant", "content": "red"}]},
], ids=["messages", "llava", "trl-images"])
def test_an_image_row_read_as_text_is_refused_rather_than_its_image_dropped(row):
    from workbench.data.formats import to_example

    with pytest.raises(DatasetFormatError) as err:
        to_example(row, "auto", "line 3 of train.jsonl")
    message = str(err.value)
    assert "\n" not in message and message.startswith("line 3 of train.jsonl: ")
    assert "vision-language model" in message and "model.id" in message


def test_a_rows_side_of_the_split_is_the_same_wherever_the_data_lives(tmp_path):
    """The built-in set copied to two folders (so every image path differs) is prepared from
    each: the same rows, named by picture file and text, land on each side."""
    from workbench.data.vision import prepare_vision_data
    from workbench.spec import RunSpec

    built = builtin_image_dataset_path(split="train").parent
    sides = []
    for where in ("a", "b/deeper"):
        shutil.copytree(built, tmp_path / where / "set")
        spec = RunSpec(model={"id": "builtin:tiny-qwen2-vl"}, data={
            "sources": [{"path": str(tmp_path / where / "set" / "train.jsonl")}],
            "validation_fraction": 0.2})
        prepare_vision_data(spec, tmp_path / where / "out")
        named = {}
        for side in ("train", "validation"):
            lines = (tmp_path / where / "out" / f"{side}.jsonl").read_text().splitlines()
            named[side] = sorted(
                tuple(Path(p["image"]).name if p["type"] == "image" else p["text"]
                      for m in json.loads(line)["messages"] for p in m["content"])
                for line in lines)
        sides.append(named)
    assert sides[0]["validation"] and sides[0]["train"]
    assert sides[0] == sides[1]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("targets", ["all-linear", ["k_proj", "v_proj"]])
def test_the_plan_counts_the_adapter_peft_builds_on_a_vlm(targets):
    """The oracle is the adapter itself: the run's own model loading (peft on the tiny VLM),
    its trainable parameters counted; "all-linear" means the decoder's attention for a VLM."""
    import workbench
    from workbench.spec import RunSpec
    from workbench.spec.models import resolve_model
    from workbench.train.vision import load_model

    spec = RunSpec(model={"id": "builtin:tiny-qwen2-vl"}, method={"target_modules": targets},
                   data={"sources": [{"path": "builtin:teaching-images"}]})
    model = load_model(spec, resolve_model(spec.model.id))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable > 0
    assert workbench.plan(spec).trainable_params == trainable


def test_the_specs_pixel_cap_sizes_each_image_as_the_processors_own_setting_would(vlm, tmp_path):
    """``data.image_max_pixels`` must count, batch and save each image as a processor whose own
    preprocessor_config.json has that cap does. The oracle is such a copy of the model, its rows
    processed by transformers with their real pixels."""
    import workbench
    from workbench.spec import RunSpec
    from workbench.train.vision import load_processor as run_processor

    model = _wide_vlm(vlm, tmp_path / "wide-vlm")  # up to 64 tokens an image
    capped = tmp_path / "capped-vlm"
    shutil.copytree(model, capped)
    config = json.loads((capped / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = 4 * 28 * 28
    (capped / "preprocessor_config.json").write_text(json.dumps(config))
    path = _sized_rows(tmp_path)
    lengths, image_tokens = _processed(capped, path)
    # One token per 28x28 pixels, at most four: the 84x84 picture is shrunk to 56x56.
    assert image_tokens[:3] == [1, 2, 4] and max(image_tokens) == 4, image_tokens

    spec = RunSpec(model={"id": str(model)}, train={"batch_size": 1},
                   resources={"processes_per_node": 1},
                   data={"sources": [{"path": str(path)}], "validation_fraction": 0,
                         "max_length": 512, "image_max_pixels": 4 * 28 * 28})
    plan = workbench.plan(spec)
    train = plan.data_tokens["splits"]["train"]
    assert (train["tokens"]["min"], train["tokens"]["max"]) == (min(lengths), max(lengths))
    assert plan.tokens_per_step == round(sum(lengths) / len(lengths)), plan.data_note
    # What the ranks batch with, what they save beside the adapter, and what evaluation loads
    # back from there: the same cap.
    processor = run_processor(spec, str(model))
    assert [image_token_count(processor, *size) for size in _SIZES] == image_tokens
    processor.save_pretrained(tmp_path / "adapter")
    again = load_processor(model, saved=tmp_path / "adapter")
    assert [image_token_count(again, *size) for size in _SIZES] == image_tokens


def test_pixel_bounds_that_cannot_hold_are_refused_in_one_line(vlm, tmp_path):
    from transformers import CLIPImageProcessor

    from workbench.errors import DatasetError, SpecError
    from workbench.spec import RunSpec

    with pytest.raises(SpecError, match=r"image_min_pixels \(5000\) is above image_max_pixels"):
        RunSpec(data={"image_min_pixels": 5000, "image_max_pixels": 1000})
    # A floor above the processor's own cap (84x84 pixels for the built-in).
    with pytest.raises(DatasetError, match=r"image_min_pixels \(1000000\) is above") as info:
        load_processor(vlm, min_pixels=1_000_000)
    assert "\n" not in str(info.value)
    # A processor that resizes to a fixed size, not to a pixel budget, would ignore the cap.
    CLIPImageProcessor().save_pretrained(tmp_path / "clip")
    with pytest.raises(DatasetError, match="sizes images its own way.*remove them") as info:
        load_processor(vlm, max_pixels=4 * 28 * 28, saved=tmp_path / "clip")
    assert "\n" not in str(info.value)
