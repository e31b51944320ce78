"""Data in: every file type and format, response-only labels, truncation, and each bad input."""

from __future__ import annotations

import json
import os

import pytest

from workbench.data.formats import to_example
from workbench.data.prepare import prepare_data, preview_rows
from workbench.data.sources import read_rows
from workbench.data.split import assign_split
from workbench.data.tokenize import IGNORE, Collator, tokenize_example
from workbench.errors import DatasetError, DatasetFormatError, EmptyDatasetError, SpecError
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


def test_empty_dataset_is_a_typed_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    spec = RunSpec(data={"sources": [{"path": str(tmp_path / "empty.jsonl")}]})
    with pytest.raises(EmptyDatasetError, match="has no rows"):
        prepare_data(spec, tmp_path / "out")
    with pytest.raises(EmptyDatasetError, match="has no rows"):
        preview_rows(spec.data.sources[0])


def _alpaca_file(path, outputs):
    path.write_text("".join(json.dumps({"instruction": "Say it.", "input": "", "output": o}) + "\n"
                            for o in outputs))
    return str(path)


def test_empty_training_split_after_the_validation_split(tmp_path):
    # Rows exist, but a validation fraction near 1 sends both of them to validation.
    path = _alpaca_file(tmp_path / "two.jsonl", ["yes", "no"])
    spec = RunSpec(data={"sources": [{"path": path}], "validation_fraction": 0.999})
    with pytest.raises(EmptyDatasetError, match=r"no training examples.*\(2 went to validation\)"
                       r".*lower data.validation_fraction") as info:
        prepare_data(spec, tmp_path / "out")
    assert "after cleaning" not in str(info.value)


def test_empty_training_split_after_cleaning(tmp_path):
    # Every row is shorter than the length step's floor: cleaning keeps nothing.
    path = _alpaca_file(tmp_path / "short.jsonl", [f"answer {i}" for i in range(6)])
    spec = RunSpec(data={"sources": [{"path": path}],
                         "clean": {"enabled": True, "steps": ["length"],
                                   "options": {"length": {"min_chars": 10_000}}}})
    with pytest.raises(EmptyDatasetError, match="no training examples are left after cleaning"):
        prepare_data(spec, tmp_path / "out")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_prepare_writes_split_files_and_summary(tmp_path):
    summary = prepare_data(RunSpec(), tmp_path)
    train = (tmp_path / "train.jsonl").read_text().splitlines()
    val = (tmp_path / "validation.jsonl").read_text().splitlines()
    assert summary.counts == {"train": len(train), "validation": len(val)}
    # Every non-blank line of the built-in file is one example, in exactly one split.
    from workbench.assets.teaching import builtin_dataset_path

    lines = [ln for ln in builtin_dataset_path().read_text().splitlines() if ln.strip()]
    assert len(train) + len(val) == summary.per_source[0]["rows"] == len(lines)
    assert not set(train) & set(val)
    assert 0 < len(val) < 0.2 * len(lines)  # validation_fraction 0.1, by content hash
    assert json.loads((tmp_path / "summary.json").read_text())["counts"] == summary.counts


def test_a_csv_of_questions_and_answers_is_refused_with_the_mapping_that_fixes_it(tmp_path):
    import csv

    path = tmp_path / "qa.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "Question", "Answer", "topic"])
        w.writerows([[1, "What is 2+2?", "4", "math"], [2, "Capital of France?", "Paris", "geo"],
                     [3, "Opposite of up?", "down", "words"]])
    with pytest.raises(DatasetFormatError) as info:
        prepare_data(RunSpec(data={"sources": [{"path": str(path)}]}), tmp_path / "a")
    assert "columns: {prompt: Question, response: Answer}" in str(info.value)
    # The suggestion, taken as it is, works: the rows train as question -> answer.
    spec = RunSpec(data={"sources": [{"path": str(path),
                                      "columns": {"prompt": "Question", "response": "Answer"}}],
                         "validation_fraction": 0})
    prepare_data(spec, tmp_path / "b")
    rows = [json.loads(x) for x in (tmp_path / "b" / "train.jsonl").read_text().splitlines()]
    assert sorted(tuple(m["content"] for m in r["messages"]) for r in rows) == [
        ("Capital of France?", "Paris"), ("Opposite of up?", "down"), ("What is 2+2?", "4")]


def test_columns_name_the_parts_of_preference_and_chat_data(tmp_path):
    from workbench.data.preference import normalise

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"q": "Opposite of up?", "good": "down", "bad": "left"}) + "\n")
    source = DataSource(path=str(pairs), columns={"prompt": "q", "chosen": "good",
                                                  "rejected": "bad"})
    [(where, row)] = list(read_rows(source))
    assert normalise(row, "dpo", where)[0] == {
        "prompt": [{"role": "user", "content": "Opposite of up?"}],
        "chosen": [{"role": "assistant", "content": "down"}],
        "rejected": [{"role": "assistant", "content": "left"}]}
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"dialogue": [{"from": "human", "value": "hi"},
                                             {"from": "gpt", "value": "hello"}]}) + "\n")
    [ex] = preview_rows(DataSource(path=str(chat), columns={"messages": "dialogue"}))
    assert ex == {"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}]}
    with pytest.raises(DatasetFormatError, match=r"no column\(s\) \['dialog'\].*'dialogue'"):
        preview_rows(DataSource(path=str(chat), columns={"messages": "dialog"}))
    with pytest.raises(SpecError, match="data.sources.0.columns.*unknown part"):
        RunSpec(data={"sources": [{"path": str(chat), "columns": {"promt": "q"}}]})


def test_prepared_data_is_reused_by_content_and_redone_when_the_bytes_change(tmp_path):
    src = tmp_path / "rows.jsonl"
    rows = [{"instruction": f"Say {w}.", "output": w} for w in
            ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = RunSpec(data={"sources": [{"path": str(src)}], "validation_fraction": 0.25})
    first = prepare_data(spec, tmp_path / "a", cache=True)
    again = prepare_data(spec, tmp_path / "b", cache=True)
    for name in ("train.jsonl", "validation.jsonl", "summary.json"):
        # The same files, linked rather than written again, and the same summary.
        assert (tmp_path / "a" / name).stat().st_ino == (tmp_path / "b" / name).stat().st_ino
    assert (again.counts, again.per_source, again.preview) == \
        (first.counts, first.per_source, first.preview)
    # One answer changed in place, same size and same modification time: still seen.
    stat = src.stat()
    src.write_text(src.read_text().replace('"golf"}', '"gulf"}'))
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert src.stat().st_size == stat.st_size
    prepare_data(spec, tmp_path / "c", cache=True)
    text = "".join((tmp_path / "c" / f"{s}.jsonl").read_text() for s in ("train", "validation"))
    assert '"content": "gulf"' in text and '"content": "golf"' not in text
    # The earlier run's files are untouched by the new preparation.
    earlier = "".join((tmp_path / "a" / f"{s}.jsonl").read_text() for s in ("train", "validation"))
    assert '"content": "golf"' in earlier and "gulf" not in earlier
    # Other settings on the same bytes are another preparation, not the cached one.
    half = prepare_data(spec.updated(**{"data.validation_fraction": 0.5}), tmp_path / "d",
                        cache=True)
    assert (tmp_path / "d" / "train.jsonl").stat().st_ino != \
        (tmp_path / "c" / "train.jsonl").stat().st_ino
    assert half.counts["validation"] + half.counts["train"] == len(rows)


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


def test_max_length_truncates_and_the_collator_pads(tokenizer):
    ex = to_example({"instruction": "word " * 100, "output": "x"}, "alpaca", "l1")
    assert len(tokenize_example(ex, tokenizer, max_length=32)["input_ids"]) == 32
    rows = [{"input_ids": list(range(10)), "labels": list(range(10))} for _ in range(5)]
    batch = Collator(pad_token_id=0)([rows[0], {"input_ids": [5], "labels": [5]}])
    assert batch["labels"][1].tolist() == [5] + [IGNORE] * 9
    assert batch["attention_mask"][1].sum().item() == 1


def test_model_sources_builtin_folder_hub_and_missing(tiny_model, tmp_path):
    from workbench.errors import ModelNotFoundError
    from workbench.spec.models import load_config, resolve_model

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


# -- chat masks, truncation, statistics (tokenise once) ---------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What does a cow say?"},
    {"role": "assistant", "content": "moo"},
    {"role": "user", "content": "And a dog?"},
    {"role": "assistant", "content": "woof  twice\n\nloudly"},  # inner blank line is trained
    {"role": "user", "content": "A cat?"},
    {"role": "assistant", "content": "meow"},
]

# A layout unlike the built-in one: no BOS, role names inside the start marker, and a system turn
# that becomes a default when missing.
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Strips contents: splicing contents into a rendered layout would be wrong, so it must not be used.
TRIMMING = (
    "{% for m in messages %}"
    "{{ '[' + m['role'] + '] ' + (m['content'] | trim) + ' [/' + m['role'] + ']' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)


def _trained_runs(enc, tokenizer) -> list[str]:
    """The decoded text of each contiguous run of trained tokens."""
    runs, current = [], []
    for tok, lab in zip(enc.input_ids, enc.labels):
        if lab == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            assert lab == tok
            current.append(tok)
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


@pytest.fixture
def chatml_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.eos_token = "<|im_end|>"
    return tok


@pytest.mark.parametrize("layout", ["builtin", "chatml", "trimming"])
def test_multi_turn_trains_every_assistant_turn_and_nothing_else(layout, tokenizer,
                                                                 chatml_tokenizer):
    from workbench.data.tokenize import ChatRenderer, encode_batch

    tok = chatml_tokenizer if layout == "chatml" else tokenizer
    if layout == "trimming":
        tok.chat_template = TRIMMING
    end = {"builtin": "<|end|>", "chatml": "<|im_end|>", "trimming": " [/assistant]"}[layout]
    # This BPE merges the space before a word into it: that template's space before the answer
    # comes with the answer's first token.
    lead = " " if layout == "trimming" else ""
    answers = ["moo", "woof  twice\n\nloudly", "meow"]
    convo = [dict(m) for m in CONVERSATION]
    if layout == "trimming":  # padded contents: a spliced render would keep the padding
        convo = [{**m, "content": f"  {m['content']} "} for m in convo]
    renderer = ChatRenderer(tok)
    for _ in range(6):  # past the checked renders, onto the fast path where there is one
        enc = encode_batch([{"messages": convo}], tok, 512, renderer=renderer)[0]
        assert _trained_runs(enc, tok) == [lead + a + end for a in answers]
        assert not enc.truncated and enc.trainable == len([x for x in enc.labels if x != IGNORE])
    prompt_end = tok.decode(enc.input_ids[:enc.prompt_tokens])
    assert prompt_end.endswith({"builtin": "<|assistant|>\n", "chatml": "<|im_start|>assistant\n",
                                "trimming": "[assistant]"}[layout])


LONG_PROMPT = {"messages": [{"role": "system", "content": "Answer yes or no."},
                            {"role": "user", "content": "Is this long? " + "word " * 200},
                            {"role": "assistant", "content": "yes"}]}


def test_keep_response_truncation_keeps_the_answer_and_right_loses_it(tokenizer):
    from workbench.data.tokenize import encode_batch

    kept = encode_batch([LONG_PROMPT], tokenizer, 64, "keep_response")[0]
    assert len(kept.input_ids) == 64 and kept.truncated
    assert _trained_runs(kept, tokenizer) == ["yes<|end|>"]
    text = tokenizer.decode(kept.input_ids)
    assert text.startswith("<|bos|> word") and text.endswith("word <|end|>\n<|assistant|>\nyes<|end|>\n")
    answer = tokenizer("yes<|end|>\n", add_special_tokens=False)["input_ids"]
    assert kept.prompt_tokens > 200 and kept.response_tokens == len(answer)
    lost = encode_batch([LONG_PROMPT], tokenizer, 64, "right")[0]
    assert len(lost.input_ids) == 64 and lost.trainable == 0
    # A response longer than the budget keeps its start, and at least half of max_length.
    long_answer = {"messages": [{"role": "user", "content": "word " * 100},
                                {"role": "assistant", "content": "yes " * 100}]}
    both = encode_batch([long_answer], tokenizer, 64)[0]
    assert len(both.input_ids) == 64 and both.trainable == 32
    assert tokenizer.decode([t for t, lab in zip(both.input_ids, both.labels)
                             if lab != IGNORE]).startswith("yes yes")


def test_token_stats_count_truncated_and_dropped_and_refuse_too_many(tmp_path, tokenizer):
    from workbench.data.tokenized import check_trainable, token_stats
    from workbench.errors import DataTruncationError

    short = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(195)]
    long = [{"system": "Answer yes or no.", "instruction": f"Case {i}: " + "word " * 200,
             "output": "yes"} for i in range(5)]
    path = _write_jsonl(tmp_path / "mixed.jsonl", short + long)
    base = {"sources": [{"path": str(path)}], "max_length": 64, "validation_fraction": 0.0}
    kept = token_stats(RunSpec(data=base), tokenizer)
    train = kept.splits["train"]
    assert (train.examples, train.truncated, train.dropped) == (200, 5, 0)
    assert train.tokens["max"] > 200 and train.prompt_tokens["max"] > 200
    assert train.response_tokens["min"] >= 2  # the answer digits and <|end|>
    # Every example trains its answer and end token, and no prompt token is trained.
    assert 2 * 200 <= kept.trainable_tokens_per_epoch <= (
        sum(train.lengths) - 200 * train.prompt_tokens["min"])
    hist = kept.histogram()
    assert sum(hist["counts"]) == 200 and hist["edges"][-1] >= train.tokens["max"]
    check_trainable(kept, RunSpec(data=base))  # nothing lost: accepted
    right = RunSpec(data={**base, "truncation": "right"})
    lost = token_stats(right, tokenizer)
    assert (lost.splits["train"].truncated, lost.splits["train"].dropped) == (0, 5)
    with pytest.raises(DataTruncationError) as info:
        check_trainable(lost, right)  # 2.5% lost, above the default 1%
    msg = str(info.value)
    assert "5 lose every response token" in msg and "of 200" in msg and "max_length" in msg
    check_trainable(lost, RunSpec(data={**base, "truncation": "right",
                                        "max_dropped_fraction": 0.05}))


def test_eval_sample_is_bounded_and_deterministic():
    from workbench.data.tokenized import eval_sample

    rows = [{"i": i} for i in range(1000)]
    a, b = eval_sample(rows, 256, seed=3), eval_sample(rows, 256, seed=3)
    assert a == b and len(a) == 256 and len({r["i"] for r in a}) == 256
    assert a != eval_sample(rows, 256, seed=4)
    assert eval_sample(rows, 0, 3) == rows and eval_sample(rows, None, 3) == rows
    assert eval_sample(rows[:10], 256, 3) == rows[:10]


def test_old_run_dirs_without_tokenized_data_still_load(tmp_path, tokenizer):
    from workbench.runs.rundir import RunDir
    from workbench.train.run import load_split

    rd = RunDir(tmp_path / "old-run")
    spec = RunSpec()
    rd.create(spec)
    prepare_data(spec, rd.data_dir)  # what launch wrote before tokenise-once: jsonl only
    rows = load_split(rd, "train", tokenizer, spec)
    n = len((rd.data_dir / "train.jsonl").read_text().splitlines())
    assert len(rows) == n and any(lab != IGNORE for lab in rows[0]["labels"])


def test_a_run_without_a_validation_split_loads_an_empty_one(tmp_path, tokenizer):
    # validation_fraction 0: the tokenised validation split has no rows, and every rank must
    # still load it (it did not: an empty split is saved as zero shards).
    from workbench.data.tokenized import prepare_tokenized
    from workbench.runs.rundir import RunDir
    from workbench.train.run import load_split

    spec = RunSpec(data={"validation_fraction": 0.0})
    rd = RunDir(tmp_path / "no-validation").create(spec)
    prepare_data(spec, rd.data_dir)
    prepare_tokenized(spec, rd, tokenizer)
    n = len((rd.data_dir / "train.jsonl").read_text().splitlines())
    assert len(load_split(rd, "train", tokenizer, spec)) == n > 0
    assert len(load_split(rd, "validation", tokenizer, spec)) == 0


def test_run_form_preview_shows_token_lengths_against_max_length(tmp_path):
    from workbench.widgets import RunForm
    from workbench.widgets.run_form import length_figure

    rows = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(20)]
    rows += [{"instruction": "word " * 300, "output": "yes"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    form = RunForm(RunSpec(data={"sources": [{"path": str(path)}], "max_length": 64,
                                 "validation_fraction": 0.0}))
    text = "".join(o.get("text", "") for o in form.lengths.outputs)
    assert "train: 21 examples" in text and "1 truncated, 0 dropped" in text
    assert any(o.get("output_type") == "display_data" for o in form.lengths.outputs)
    stats = form.update_lengths()
    fig = length_figure(stats)
    if hasattr(fig, "axes"):  # matplotlib, where plotly is not installed
        ax = fig.axes[0]
        marker, heights = ax.lines[0].get_xdata()[0], [p.get_height() for p in ax.patches]
    else:
        marker, heights = fig.layout.shapes[0].x0, list(fig.data[0].y)
    assert marker == 64  # the max_length marker
    assert sum(heights) == 21


def test_tokenised_split_keeps_every_row_in_order_across_batches(tmp_path, tokenizer):
    """Tokenising overlaps one batch's encode with the next one's render (1,000 rows a batch):
    every row must come out once, in file order, trained on its own answer, with the rows that
    lose their whole answer counted, not kept."""
    from workbench.data.tokenized import tokenize_split

    rows, expected, lost = [], [], 0
    for i in range(2300):  # three batches, the last one short
        long = i % 500 == 7  # a prompt far past max_length: "right" truncation cuts its answer
        prompt = "word " * 80 if long else f"Say {i}."
        rows.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": f"ans{i}"}]})
        if long:
            lost += 1
        else:
            expected.append(f"ans{i}<|end|>")
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    spec = RunSpec.coerce({"data": {"max_length": 48, "truncation": "right",
                                    "max_dropped_fraction": 1.0}})
    table, stats = tokenize_split(path, spec, tokenizer)
    trained = [tokenizer.decode([t for t in labels if t != IGNORE])
               for labels in table.column("labels").to_pylist()]
    assert trained == expected
    assert (stats.examples, stats.dropped, stats.kept) == (2300, lost, 2300 - lost)



_LOAD_FAST = r"""
import json, sys
from workbench.data.tokenize import load_tokenizer
from workbench.spec import RunSpec

tok = load_tokenizer(RunSpec.coerce({}), sys.argv[1])
chat = json.loads(sys.argv[2])
print(json.dumps({
    "auto_imported": "transformers.models.auto.tokenization_auto" in sys.modules,
    "seen": [type(tok).__name__, tok.backend_tokenizer.to_str(), tok.chat_template,
             tok.bos_token, tok.eos_token, tok.pad_token, tok.pad_token_id,
             tok(["Repeat 12.", " a  b\tc"])["input_ids"],
             tok.apply_chat_template(chat, tokenize=False),
             tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)]}))
"""


def test_builtin_tokenizer_is_autotokenizers_without_importing_its_registry(tiny_model,
                                                                             tokenizer):
    """Launch loads the built-in model's tokenizer to tokenise; AutoTokenizer's model registry
    costs ~2 CPU seconds to import, so the built-in one is loaded by its class (in a fresh
    process: this one has imported the registry), which must be exactly what AutoTokenizer gives
    (vocabulary, special tokens, template, encodings)."""
    import subprocess
    import sys

    from workbench.data.tokenize import ensure_chat_template

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there?"},
            {"role": "assistant", "content": " hello\n"}]
    out = subprocess.run([sys.executable, "-c", _LOAD_FAST, str(tiny_model), json.dumps(chat)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    got = json.loads(out.splitlines()[-1])
    ensure_chat_template(tokenizer)  # what load_tokenizer does after loading
    assert not got["auto_imported"]
    assert got["seen"] == [
        type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template,
        tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.pad_token_id,
        tokenizer(["Repeat 12.", " a  b\tc"])["input_ids"],
        tokenizer.apply_chat_template(chat, tokenize=False),
        tokenizer.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)]


def test_building_the_tiny_model_prints_no_progress_bar(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    from workbench.assets.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # put back as it was
