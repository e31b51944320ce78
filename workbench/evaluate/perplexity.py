"""The ``perplexity`` task: how surprised the weights are by a file's text, token by token.

Each row is scored on its own (no packing across rows): every token of a plain ``text`` row; for
a chat row (rendered with the model's chat template), the tokens of its last assistant turn, the
end-of-turn token included and the newline a template writes after it left out: exactly the
tokens training's loss is taken on (:func:`workbench.data.token_spans.span_labels`). So on a
run's validation split of one-turn chats, ``perplexity == exp(eval_loss)`` of the same weights
(up to the Trainer averaging per batch); scoring the template's newline too, as a "whole text"
perplexity would, makes it tens of times larger, since no training step ever predicts it.
``perplexity = exp(total NLL / predicted tokens)``, the mean over every predicted token of the
set, so long rows weigh more, as in training's loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from workbench.errors import EvalError, EvalTaskError

# What the figure measures, written beside it in eval.jsonl and shown wherever it is shown.
SCORED = "answer tokens (as eval_loss); every token of text rows"


def load_texts(path: str | Path, tokenizer: Any, max_samples: int | None
               ) -> list[tuple[str, int, int]]:
    """(text, first scored character, end of the scored characters) per row of a
    jsonl/csv/parquet file: text rows whole, chat rows through the chat template from where the
    last assistant turn starts to where its end-of-turn token ends."""
    from workbench.data.formats import to_example
    from workbench.data.sources import read_rows
    from workbench.errors import DatasetError
    from workbench.spec.sections import DataSource

    if not Path(path).is_file():
        raise EvalTaskError(f"perplexity file {path} does not exist; give a jsonl file with a "
                            "text field (or chat rows), or leave file out for the validation split")
    texts: list[tuple[str, int, int]] = []
    try:
        for where, row in read_rows(DataSource(path=str(path))):
            ex = to_example(row, "auto", where)
            if "text" in ex:
                texts.append((ex["text"], 0, len(ex["text"])))
                continue
            msgs = ex["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            prompt = tokenizer.apply_chat_template(msgs[:last], tokenize=False,
                                                   add_generation_prompt=True)
            full = tokenizer.apply_chat_template(msgs[:last + 1], tokenize=False)
            # Training's labels stop at the end-of-turn token: whitespace after it is layout.
            texts.append((full, len(prompt) if full.startswith(prompt) else 0,
                          len(full.rstrip())))
            if max_samples is not None and len(texts) >= max_samples:
                break
    except DatasetError as exc:
        raise EvalTaskError(f"perplexity file {path}: {exc}") from None
    if not texts:
        raise EvalTaskError(f"perplexity file {path} has no rows; add some")
    return texts


def run(source: Any, texts: list[tuple[str, int, int]], max_length: int = 1024
        ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, per-row rows): perplexity, nll (mean per token) and the number of tokens."""
    import torch

    if getattr(source, "kind", None) != "transformers":
        raise EvalError("perplexity needs the weights (log-likelihoods of every token); evaluate "
                        "the run or a model folder, not an endpoint")
    model, tok = source.model, source.tokenizer
    device = next(model.parameters()).device
    total_nll, total_tokens, rows = 0.0, 0, []
    with source.inference():
        for text, start, end in texts:
            # A chat template writes its own BOS: adding another would score a doubled one.
            bos = bool(tok.bos_token) and text.startswith(tok.bos_token)
            part = start > 0 or end < len(text)
            enc = tok(text, return_tensors="pt", truncation=True, max_length=max_length,
                      add_special_tokens=not bos, return_offsets_mapping=part)
            ids = enc["input_ids"].to(device)
            targets = ids[0, 1:].clone()
            if part:  # only the answer's tokens count (-100: ignored by cross_entropy)
                # As training's labels: from the first token that ends inside the answer (a
                # byte-level BPE merges the space before it into it), to the last that starts there.
                spans = enc["offset_mapping"][0, 1:].to(device)
                targets[(spans[:, 1] <= start) | (spans[:, 0] >= end)] = -100
            count = int((targets != -100).sum())
            if count == 0:
                continue  # nothing to predict
            logits = model(input_ids=ids).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum",
                                                    ignore_index=-100).item()
            total_nll += nll
            total_tokens += count
            rows.append({"text": text[start:min(end, start + 200)], "tokens": count,
                         "nll": nll / count,
                         "perplexity": math.exp(nll / count)})
    if total_tokens == 0:
        raise EvalTaskError("every row is shorter than two tokens: nothing to score")
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": float(total_tokens)}, rows
