"""Padding-free packing: packed examples give the same per-example loss as unpacked ones (the
attention of one never reaches another), and a packed run trains on 2 processes."""

from __future__ import annotations

import json

import pytest

from workbench.data.tokenize import IGNORE, Collator, encode_batch, pack

QUESTIONS = [("What does a cow say?", "moo"), ("Colour of snow?", "white"),
             ("Opposite of up, in one word please?", "down"), ("Two plus two?", "four"),
             ("Name a fruit that is yellow and curved.", "banana"), ("Hi", "hello there")]


@pytest.fixture(scope="module")
def model_and_examples(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for q, a in QUESTIONS]
    examples = [{"input_ids": e.input_ids, "labels": e.labels}
                for e in encode_batch(chats, tok, 64)]
    examples.append({"input_ids": tok("plain text to learn")["input_ids"],
                     "labels": tok("plain text to learn")["input_ids"]})  # every token trained
    return model, examples


def _loss(logits, labels) -> float:
    """Mean next-token cross-entropy over each example's trained tokens, computed here."""
    import torch.nn.functional as F

    return float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="mean"))


def test_packed_examples_have_the_losses_they_have_alone(model_and_examples):
    import torch

    model, examples = model_and_examples
    with torch.no_grad():
        alone = [_loss(model(input_ids=torch.tensor([e["input_ids"]])).logits[0],
                         torch.tensor(e["labels"])) for e in examples]
        rows = pack(examples, 64)
        assert len(rows) < len(examples)  # several examples share a row
        batch = Collator(pad_token_id=0)(rows)  # two rows of a batch, laid end to end
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        # use_cache=False as under the Trainer (TrainingArguments.use_cache defaults to False):
        # transformers reads example boundaries from position_ids only when there is no cache.
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits[0]
        # The same without position ids: one causal mask over everything, as packing was before.
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    starts = [k for k, p in enumerate(batch["position_ids"][0].tolist()) if p == 0]
    assert len(starts) == len(examples)
    bounds = list(zip(starts, starts[1:] + [batch["input_ids"].shape[1]]))
    for (a, b), e, loss in zip(bounds, examples, alone):
        assert batch["input_ids"][0, a:b].tolist() == e["input_ids"]
        labels = torch.tensor(e["labels"])
        # fp32 on CPU, the same weights: only summation order differs.
        assert _loss(packed[a:b], labels) == pytest.approx(loss, abs=1e-5)
    later = [abs(_loss(leaky[a:b], torch.tensor(e["labels"])) - loss)
             for (a, b), e, loss in zip(bounds[1:], examples[1:], alone[1:])]
    assert max(later) > 1e-3  # the check can fail: attention across examples changes losses
    # No label points across a boundary, and every trained token of every example is still there.
    flat = batch["labels"][0].tolist()
    assert all(flat[a] == IGNORE for a, _ in bounds)
    assert sum(lab != IGNORE for lab in flat) == sum(
        sum(lab != IGNORE for lab in e["labels"][1:]) for e in examples)


def test_pack_keeps_examples_whole_and_under_the_row_length():
    rows = [{"input_ids": list(range(10)), "labels": list(range(10))} for _ in range(5)]
    packed = pack(rows, 25)
    assert [len(r["input_ids"]) for r in packed] == [20, 20, 10]
    assert packed[0]["position_ids"] == list(range(10)) * 2
    assert packed[0]["labels"] == [IGNORE] + list(range(1, 10)) + [IGNORE] + list(range(1, 10))


@pytest.mark.slow
def test_a_packed_run_trains_on_two_processes(tmp_path):
    import workbench

    rows = [{"instruction": f"Repeat the number {i}.", "output": str(i)} for i in range(200)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = workbench.launch({"name": "packed", "data": {"sources": [{"path": str(path)}],
                                                      "max_length": 64, "packing": True},
                            "train": {"max_steps": 4, "batch_size": 2, "eval_every": 2},
                            "resources": {"processes_per_node": 2}})
    assert job.wait(timeout=900, progress=False) == "succeeded", job.logs(tail=40)
    losses = [m["loss"] for m in job.metrics() if "loss" in m]
    evals = [m["eval_loss"] for m in job.metrics() if "eval_loss" in m]
    assert losses and evals and all(x == x for x in losses + evals)  # real numbers, not NaN
    for rank in ("rank-0.log", "rank-1.log"):
        log = (job.run_dir.logs_dir / rank).read_text()
        assert "data: train loaded" in log
    from workbench.data.tokenized import load_tokenized

    train = load_tokenized(job.run_dir.data_dir, "train")
    assert "position_ids" in train.column_names
    assert max(len(r) for r in train["input_ids"]) <= 64 and len(train) < 180
