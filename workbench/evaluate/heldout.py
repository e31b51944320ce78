"""The ``heldout`` task: answer held-out prompts greedily and score the answers against references.

Metrics (one line in eval.jsonl): ``exact_match`` and ``contains`` (0-1, after case and space
normalisation), ``rouge_l`` (F1, 0-1, rouge-score), ``bleu`` and ``chrf`` (0-100, sacrebleu;
``bleu`` only where the median reference has 4 words or more: below that it is 0 for any answer).
Chinese text is tokenised per character for ROUGE (rouge-score's own tokenizer drops CJK
characters) and with sacrebleu's ``zh`` tokenizer for BLEU; the choice is made once per set, from
the references.

    >>> scores(["moo"], ["Moo "])["exact_match"]
    1.0
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workbench.errors import EvalTaskError

Messages = list[dict[str, str]]
# CJK unified ideographs (+ extension A, compatibility), kana and hangul: scored per character.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]")
_WORD = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]|\w+")


def load_examples(path: str | Path, max_samples: int | None) -> list[tuple[Messages, str]]:
    """(prompt messages, reference answer) pairs from a jsonl/csv/parquet file in any chat format
    Workbench trains on (messages, sharegpt, alpaca): the last assistant turn is the reference."""
    from workbench.data.formats import row_has_image, to_example
    from workbench.data.sources import read_rows
    from workbench.spec.sections import DataSource

    if not Path(path).is_file():
        raise EvalTaskError(f"eval file {path} does not exist; give a jsonl file of prompts and "
                            "answers (messages or alpaca format), or leave file out to use the "
                            "run's validation split")
    def conversations() -> Any:
        for where, row in read_rows(DataSource(path=str(path))):
            if row_has_image(row):
                raise EvalTaskError(
                    f"eval file {path}: {where} holds an image, which a text model cannot read; "
                    "evaluate a vision-language model (builtin:tiny-qwen2-vl or a run of one) "
                    "on image rows, or give a file of text prompts and answers")
            ex = to_example(row, "auto", where)
            if "messages" not in ex:
                raise EvalTaskError(f"{where}: a text row has no answer to compare with; heldout "
                                    "needs prompts and answers (messages or alpaca format); "
                                    "score plain text with the perplexity task instead")
            yield ex["messages"]

    return prompt_answer_pairs(path, conversations(), max_samples)


def prompt_answer_pairs(path: str | Path, conversations: Any, max_samples: int | None
                        ) -> list[tuple[Any, str]]:
    """(prompt, reference) of each conversation (at most ``max_samples``): the last assistant
    turn's text is the reference, the turns before it the prompt. A row the reader refuses is an
    :class:`EvalTaskError` naming ``path``."""
    from workbench.errors import DatasetError

    out: list[tuple[Any, str]] = []
    try:
        for msgs in conversations:
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            answer = msgs[last]["content"]
            if not isinstance(answer, str):  # content parts: the text ones
                answer = "".join(p["text"] for p in answer if p["type"] == "text")
            out.append((msgs[:last], answer))
            if max_samples is not None and len(out) >= max_samples:
                break
    except DatasetError as exc:
        raise EvalTaskError(f"eval file {path}: {exc}") from None
    if not out:
        raise EvalTaskError(f"eval file {path} has no examples; add some or point at another file")
    return out


def is_chinese(texts: Sequence[str]) -> bool:
    """True when CJK characters make up a fair share of the text (then score per character)."""
    joined = "".join(texts)
    letters = sum(1 for c in joined if not c.isspace())
    return letters > 0 and len(_CJK.findall(joined)) / letters >= 0.2


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.split())


class CJKTokenizer:
    """rouge-score tokenizer: each CJK character a token, other words as runs of letters/digits."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(normalise(text))


def scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """Corpus metrics plus ``rows``: one dict of per-example scores per prediction."""
    import sacrebleu
    from rouge_score import rouge_scorer

    zh = is_chinese(references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=CJKTokenizer() if zh else None)
    rows = []
    for pred, ref in zip(predictions, references):
        p, r = normalise(pred), normalise(ref)
        rows.append({"exact_match": float(p == r), "contains": float(bool(r) and r in p),
                     "rouge_l": scorer.score(ref, pred)["rougeL"].fmeasure})
    n = max(len(rows), 1)
    out: dict[str, Any] = {k: sum(row[k] for row in rows) / n
                           for k in ("exact_match", "contains", "rouge_l")}
    refs = [list(references)]
    if bleu_means_something(references, zh):
        out["bleu"] = sacrebleu.corpus_bleu(list(predictions), refs,
                                            tokenize="zh" if zh else "13a").score
    out["chrf"] = sacrebleu.corpus_chrf(list(predictions), refs).score
    out["rows"] = rows
    return out


BLEU_MIN_WORDS = 4  # BLEU's geometric mean needs 4-grams: a shorter answer scores 0 whatever it says


def bleu_means_something(references: Sequence[str], zh: bool = False) -> bool:
    """Whether BLEU says anything about these references: their median is at least 4 words (4
    characters in Chinese). Below that, every answer has no 4-gram to match and BLEU is 0 even
    when exact match rises, so it is left out rather than shown as a score that contradicts."""
    lengths = sorted(len(_CJK.findall(r)) if zh else len(r.split()) for r in references)
    return bool(lengths) and lengths[len(lengths) // 2] >= BLEU_MIN_WORDS


def run(source: Any, examples: list[tuple[Any, str]], max_new_tokens: int,
        describe: Callable[[Any], dict[str, Any]] | None = None
        ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate with ``source`` and score: (metrics, per-example rows). ``describe`` gives a
    row's prompt fields from its messages (default: the last turn's text as ``prompt``; image
    prompts add their images: :func:`workbench.evaluate.images.describe`)."""
    prompts = [m for m, _ in examples]
    refs = [r for _, r in examples]
    preds = source.generate(prompts, max_new_tokens=max_new_tokens)
    result = scores(preds, refs)
    describe = describe or _prompt
    rows = [{**describe(m), "reference": ref, "prediction": pred, **s}
            for m, ref, pred, s in zip(prompts, refs, preds, result.pop("rows"))]
    return result, rows


def _prompt(messages: Messages) -> dict[str, Any]:
    return {"prompt": messages[-1]["content"] if messages else ""}
