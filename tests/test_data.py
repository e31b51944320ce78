"""Data in: every file type and format, response-only labels, packing, and each bad input."""

from __future__ import annotations

import json

import pytest

from workbench.data.formats import to_example
from workbench.data.prepare import prepare_data, preview_rows
from workbench.data.sources import read_rows
from workbench.data.split import assign_split
from workbench.data.tokenize import IGNORE, Collator, pack, tokenize_example
from workbench.errors import DatasetError, DatasetFormatError, EmptyDatasetError
from workbench.spec import DataSource, RunSpec

ALPACA = [{"instruction": "Opposite of up?", "input": "", "output": "down"},
          {"instruction": "Colour of snow?", "input": "one word", "output": "white"}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.fixture
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_file_types_read_the_same_rows(tmp_path):
    import datasets
    import pandas as pd

    _write_jsonl(tmp_path / "d.jsonl", ALPACA)
    (tmp_path / "d.json").write_text(json.dumps(ALPACA))
    pd.DataFrame(ALPACA).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(ALPACA).to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA)}).save_to_disk(
        str(tmp_path / "saved_dict"))
    for name in ("d.jsonl", "d.json", "d.csv", "d.parquet", "saved", "saved_dict"):
        rows = [row for _, row in read_rows(DataSource(path=str(tmp_path / name)))]
        got = [(r["instruction"], r["output"]) for r in rows]
        assert got == [(r["instruction"], r["output"]) for r in ALPACA], name


def test_formats_normalise_to_messages():
    alpaca = to_example(ALPACA[1], "auto", "line 2")
    assert alpaca["messages"][0] == {"role": "user", "content": "Colour of snow?\n\none word"}
    share = to_example({"conversations": [{"from": "system", "value": "be brief"},
                                          {"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "hello"}]}, "auto", "l1")
    assert [m["role"] for m in share["messages"]] == ["system", "user", "assistant"]
    msgs = to_example({"messages": [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}]}, "auto", "l1")
    assert msgs["messages"][1]["content"] == "b"
    assert to_example({"text": "plain"}, "auto", "l1") == {"text": "plain"}


@pytest.mark.parametrize(
    ("row", "fmt", "fragment"),
    [
        ({"instruction": "q"}, "alpaca", 'line 17 of train.jsonl has no "output" field '
                                         "(expected alpaca format: instruction/input/output)"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", "unknown speaker"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "messages",
         "no assistant turn"),
        ({"question": "q", "answer": "a"}, "auto", "cannot tell the format"),
        ({"instruction": "q", "output": 3}, "alpaca", 'field "output" must be a string'),
    ],
)
def test_malformed_rows_say_where_and_what(row, fmt, fragment):
    with pytest.raises(DatasetFormatError) as info:
        to_example(row, fmt, "line 17 of train.jsonl")
    assert fragment in str(info.value)


def test_bad_files_each_get_a_clear_error(tmp_path):
    cases = {
        "binary.jsonl": (b"\x00\x01\x02PK\x03\x04", DatasetError, "binary"),
        "gbk.jsonl": ('{"text": "中文"}\n'.encode("gbk"), DatasetError, "not UTF-8"),
        "list.jsonl": (b'{"text": "ok"}\n[1, 2]\n', DatasetFormatError,
                       "line 2 of list.jsonl is a JSON list, not an object"),
        "broken.jsonl": (b'{"text": "ok"\n', DatasetFormatError, "line 1 of broken.jsonl is not "
                                                                   "valid JSON"),
        "data.txt": (b"hello", DatasetError, "unsupported file type"),
    }
    for name, (content, exc, fragment) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(exc) as info:
            list(read_rows(DataSource(path=str(tmp_path / name))))
        assert fragment in str(info.value), name
    with pytest.raises(DatasetError, match="not found"):
        list(read_rows(DataSource(path=str(tmp_path / "missing.jsonl"))))


def test_empty_dataset_and_empty_training_split(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    spec = RunSpec(data={"sources": [{"path": str(tmp_path / "empty.jsonl")}]})
    with pytest.raises(EmptyDatasetError, match="has no rows"):
        prepare_data(spec, tmp_path / "out")
    with pytest.raises(EmptyDatasetError, match="has no rows"):
        preview_rows(spec.data.sources[0])


def test_prepare_writes_split_files_and_summary(tmp_path):
    summary = prepare_data(RunSpec(), tmp_path)
    train = (tmp_path / "train.jsonl").read_text().splitlines()
    val = (tmp_path / "validation.jsonl").read_text().splitlines()
    assert summary.counts == {"train": len(train), "validation": len(val)}
    assert len(train) + len(val) == summary.per_source[0]["rows"] == 180
    assert 0 < len(val) < 40
    assert json.loads((tmp_path / "summary.json").read_text())["counts"] == summary.counts


def test_split_is_stable_when_data_is_appended():
    texts = [f"example number {i}" for i in range(2000)]
    before = {t: assign_split(t, 0.1, seed=1) for t in texts}
    more = texts + [f"new example {i}" for i in range(500)]
    after = {t: assign_split(t, 0.1, seed=1) for t in more}
    assert all(after[t] == side for t, side in before.items())
    share = sum(side == "validation" for side in after.values()) / len(after)
    assert 0.08 < share < 0.12


def test_labels_cover_only_the_response(tokenizer):
    ex = to_example({"instruction": "What does a cow say?", "output": "moo"}, "alpaca", "l1")
    t = tokenize_example(ex, tokenizer, max_length=64)
    learnt = [tok for tok, lab in zip(t["input_ids"], t["labels"]) if lab != IGNORE]
    assert tokenizer.decode(learnt) == "moo<|end|>"
    text = tokenize_example({"text": "plain text"}, tokenizer, 64)
    assert text["labels"] == text["input_ids"]  # plain LM: loss on every token


def test_max_length_truncates_and_packing_fills_blocks(tokenizer):
    ex = to_example({"instruction": "word " * 100, "output": "x"}, "alpaca", "l1")
    assert len(tokenize_example(ex, tokenizer, max_length=32)["input_ids"]) == 32
    rows = [{"input_ids": list(range(10)), "labels": list(range(10))} for _ in range(5)]
    blocks = pack(rows, 16)
    assert [len(b["input_ids"]) for b in blocks] == [16, 16, 16, 2]
    assert sum((b["labels"] for b in blocks), []) == sum((r["labels"] for r in rows), [])
    batch = Collator(pad_token_id=0)([rows[0], {"input_ids": [5], "labels": [5]}])
    assert batch["labels"][1].tolist() == [5] + [IGNORE] * 9
    assert batch["attention_mask"][1].sum().item() == 1


def test_model_sources_builtin_folder_hub_and_missing(tiny_model, tmp_path):
    from workbench.errors import ModelNotFoundError
    from workbench.models import load_config, resolve_model

    assert resolve_model("builtin:tiny-llama") == str(tiny_model)
    assert resolve_model(str(tiny_model)) == str(tiny_model)  # a local folder
    assert load_config(str(tiny_model)).num_attention_heads == 4
    assert resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id passes through
    with pytest.raises(ModelNotFoundError, match="hub is reachable"):
        load_config("no-such-org/no-such-model")  # offline here: the hub path fails clearly
    (tmp_path / "half").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "half"))
    with pytest.raises(ModelNotFoundError, match="unknown built-in"):
        resolve_model("builtin:huge")


def test_hub_dataset_path_is_real_and_fails_clearly_offline():
    with pytest.raises(DatasetError, match="could not load dataset 'no-such-org/no-such-data'"):
        list(read_rows(DataSource(path="no-such-org/no-such-data")))
