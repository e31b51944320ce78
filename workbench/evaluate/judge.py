"""The ``judge`` task: an LLM judge compares the evaluated answers with a baseline's, pairwise.

Each prompt is judged twice, once with the evaluated answer first and once with it second, and
the two verdicts are averaged: a judge that prefers whatever comes first then scores a tie
instead of a win (position bias cancels). The baseline is the base model (a run: its adapter
turned off, or the base loaded) or, for an endpoint, the reference answers of the file.

The judge answers ``[[A]]``, ``[[B]]`` or ``[[C]]`` (tie). An answer that says none of these is
counted in ``unparseable`` and left out of the win rate; it never stops the evaluation.

Metrics: ``win_rate`` (evaluated over baseline; a tie counts half; over the parseable verdicts),
``wins``, ``losses``, ``ties``, ``unparseable`` (verdict counts), ``consistency`` (share of
prompts whose two verdicts agree once the swap is undone).
"""

from __future__ import annotations

import re
from typing import Any

# Requests in flight at a judge: often a hosted API with rate limits, so fewer than a scored
# endpoint gets (sources.CONCURRENCY).
CONCURRENCY = 8

PROMPT = """You are an impartial judge. {rubric}

[Question]
{question}
{reference}
[Answer A]
{a}

[Answer B]
{b}

Compare the two answers. Reply with your verdict only: "[[A]]" if A is better, "[[B]]" if B is
better, "[[C]]" for a tie."""

_VERDICT = re.compile(r"\[\[\s*(A|B|C|TIE)\s*\]\]", re.IGNORECASE)
_BARE = re.compile(r"^\W*(A|B|C|TIE)\W*$", re.IGNORECASE)


def parse_verdict(text: str) -> str | None:
    """'A', 'B', 'C' (tie) or None when the judge's text holds no single verdict."""
    found = {m.upper() for m in _VERDICT.findall(text or "")}
    if not found:
        bare = _BARE.match((text or "").strip())
        found = {bare.group(1).upper()} if bare else set()
    if len(found) != 1:
        return None
    v = found.pop()
    return "C" if v == "TIE" else v


def _score(verdict: str | None, evaluated_is: str) -> float | None:
    """The evaluated answer's score in one comparison: 1 win, 0.5 tie, 0 loss, None unparseable."""
    if verdict is None:
        return None
    if verdict == "C":
        return 0.5
    return 1.0 if verdict == evaluated_is else 0.0


def run(judge: Any, questions: list[str], evaluated: list[str], baseline: list[str],
        rubric: str, references: list[str] | None = None, max_new_tokens: int = 16
        ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Judge each (evaluated, baseline) pair in both orders: (metrics, per-prompt rows)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(q: str, a: str, b: str, ref: str | None) -> str:
        text = PROMPT.format(rubric=rubric, question=q, a=a, b=b,
                             reference=f"\n[Reference answer]\n{ref}\n" if ref else "")
        return str(judge.chat([{"role": "user", "content": text}], max_new_tokens=max_new_tokens))

    refs: list[str | None] = list(references) if references else [None] * len(questions)
    jobs = []
    for q, ev, base, ref in zip(questions, evaluated, baseline, refs):
        jobs += [(q, ev, base, ref), (q, base, ev, ref)]  # evaluated first, then second
    _ = judge.model  # resolve the judge's model (and reachability) once, before the threads
    pool = ThreadPoolExecutor(judge.concurrency)
    try:
        raw = list(pool.map(lambda j: ask(*j), jobs))
    finally:  # an interrupted judging (Ctrl-C, a hold's end) asks nothing more and waits for none
        pool.shutdown(wait=False, cancel_futures=True)
    counts = {"wins": 0, "losses": 0, "ties": 0, "unparseable": 0}
    rows, per_prompt, agree, both = [], [], 0, 0
    for i, q in enumerate(questions):
        first, second = raw[2 * i], raw[2 * i + 1]
        s1 = _score(parse_verdict(first), "A")
        s2 = _score(parse_verdict(second), "B")
        for s in (s1, s2):
            if s is None:
                counts["unparseable"] += 1
            else:
                counts[{1.0: "wins", 0.0: "losses", 0.5: "ties"}[s]] += 1
        valid = [s for s in (s1, s2) if s is not None]
        if valid:
            per_prompt.append(sum(valid) / len(valid))
        if s1 is not None and s2 is not None:
            both += 1
            agree += s1 == s2
        rows.append({"prompt": q, "evaluated": evaluated[i], "baseline": baseline[i],
                     "verdict_evaluated_first": first, "verdict_evaluated_second": second,
                     "score": sum(valid) / len(valid) if valid else None})
    metrics: dict[str, float] = {k: float(v) for k, v in counts.items()}
    if per_prompt:
        metrics["win_rate"] = sum(per_prompt) / len(per_prompt)
    if both:
        metrics["consistency"] = agree / both
    return metrics, rows
