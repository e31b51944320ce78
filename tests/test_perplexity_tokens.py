"""Perplexity and eval loss measure the same tokens (issue 37, item 7): on chat rows, perplexity is
exp of the mean loss over exactly the tokens training's labels cover (the answer and its
end-of-turn token, not the newline the template writes after it), so a reader can set it beside
eval_loss. Before, the template's trailing newline, which no step ever trains, was scored too and
a run with eval_loss 1.48 showed perplexity 105.6 on the same split."""

from __future__ import annotations

import json
import math

import pytest

import workbench
from workbench.data.tokenize import load_tokenizer, tokenize_example
from workbench.spec import RunSpec

CHATS = [("What sound does a cow make?", "moo"), ("What is the opposite of hot?", "cold"),
         ("Name the capital city of France.", "Paris")]


def test_chat_perplexity_is_exp_of_the_loss_on_the_trained_tokens(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in CHATS]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = workbench.evaluate(str(tiny_model), tasks=["perplexity"],
                                file=tmp_path / "chat.jsonl")
    line = report.lines[0]

    # The oracle: training's own labels for each row, and the mean cross-entropy over them,
    # computed here with torch (what eval_loss averages on a split of one-turn chats).
    spec = RunSpec()
    tok = load_tokenizer(spec, str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    nll, count = 0.0, 0
    for row in rows:
        enc = tokenize_example(row, tok, spec.data.max_length)
        ids, labels = torch.tensor(enc["input_ids"]), torch.tensor(enc["labels"])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
        for i in range(len(ids) - 1):
            if labels[i + 1] != -100:
                nll -= logp[i, labels[i + 1]].item()
                count += 1
    # Each one-word answer is one token, then the end-of-turn token: two per row.
    assert count == 2 * len(rows)
    assert line["metrics"]["tokens"] == count
    assert line["metrics"]["nll"] == pytest.approx(nll / count, rel=1e-4)
    assert line["metrics"]["perplexity"] == pytest.approx(
        math.exp(nll / count), rel=1e-4)
    # What it measures travels with the figure, in eval.jsonl and in the report's table.
    assert line["scored"] == "answer tokens (as eval_loss); every token of text rows"
    assert set(report.df()["scored"]) == {line["scored"]}
