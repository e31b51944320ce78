"""The same prompts answered side by side: the base model and each run.

Answers come from the per-example files that eval.jsonl lines point at (``examples``, written by
the scorers) when the runs have them: the newest file of each model (``base`` and each run) for
one task. Otherwise, and on request only (a button, or :meth:`AnswersView.generate`), they are
generated greedily in the kernel with :mod:`workbench.serve.infer` (the base model once per distinct
base, then each run's adapter or model), on held-out prompts: the first run's validation split.

Per-example rows are JSON objects; the prompt is read from ``prompt`` (or ``input``,
``question``), the answer from ``prediction`` (or ``output``, ``answer``, ``completion``,
``response``) and the expected answer from ``reference`` (or ``target``, ``expected``). Rows of
image questions also name their pictures (``images``): a question is its text and its pictures,
and the pictures show as thumbnails in an ``image`` column.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

import ipywidgets as W

from workbench.errors import WorkbenchError
from workbench.evaluate import results

PROMPT_KEYS = ("prompt", "input", "question")
ANSWER_KEYS = ("prediction", "output", "answer", "completion", "response")
REFERENCE_KEYS = ("reference", "target", "expected")


def _first(row: dict[str, Any], keys: Sequence[str]) -> Any:
    return next((row[k] for k in keys if k in row), None)


def _read_examples(job: Any, line: dict[str, Any]) -> list[dict[str, Any]]:
    path = job.run_dir.path / line["examples"]
    if not path.is_file():
        return []
    rows = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError:
            continue  # a half-written last row
    return rows


def _newest(lines: list[dict[str, Any]], model: str, task: str | None) -> dict[str, Any] | None:
    found = [ln for ln in lines if ln.get("examples") and ln.get("model") == model
             and (task is None or ln.get("task") == task)]
    return found[-1] if found else None


def example_answers(jobs: Sequence[Any], task: str | None = None) -> Any:
    """prompt | reference | base | one column per run, from eval example files (None if none)."""
    import pandas as pd

    per_job = [results.read(j.run_dir.path) for j in jobs]
    if task is None:  # the first task that has example rows
        task = next((ln["task"] for lines in per_job for ln in lines if ln.get("examples")), None)
        if task is None:
            return None
    # A question is its text and its pictures: "What colour is the shape?" is asked of many.
    Key = tuple[str, tuple[str, ...]]
    columns: dict[str, dict[Key, Any]] = {}
    refs: dict[Key, Any] = {}
    order: list[Key] = []
    for job, lines in zip(jobs, per_job):
        sources = [("run", job.id)]
        if "base" not in columns:
            sources.insert(0, ("base", "base"))
        for model, column in sources:
            line = _newest(lines, model, task)
            if line is None:
                continue
            answers = columns.setdefault(column, {})
            for row in _read_examples(job, line):
                prompt = _first(row, PROMPT_KEYS)
                if prompt is None:
                    continue
                key = (str(prompt), tuple(str(i) for i in row.get("images") or ()))
                if key not in refs:
                    order.append(key)
                    refs[key] = _first(row, REFERENCE_KEYS)
                answers[key] = _first(row, ANSWER_KEYS)
    if not order:
        return None
    table: dict[str, list[Any]] = {}
    if any(images for _, images in order):
        table["image"] = [list(images) for _, images in order]
    table.update(prompt=[p for p, _ in order], reference=[refs[k] for k in order])
    for column in ["base", *[j.id for j in jobs]]:
        if column in columns:
            table[column] = [columns[column].get(k) for k in order]
    return pd.DataFrame(table)


def heldout_prompts(job: Any, n: int = 5) -> list[str]:
    """The first ``n`` user prompts of a run's validation split (else of its first data source)."""
    from workbench.data.prepare import preview_rows

    path = job.run_dir.path / "data" / "validation.jsonl"
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for raw in path.read_text(encoding="utf-8").splitlines()[:n]:
            rows.append(json.loads(raw))
    if not rows:
        rows = preview_rows(job.spec.data.sources[0], n)
    prompts = []
    for ex in rows:
        users = [m["content"] for m in ex.get("messages", []) if m.get("role") == "user"]
        prompts.append(users[0] if users else str(ex.get("text", ""))[:200])
    return [p for p in prompts if p]


def generate_answers(jobs: Sequence[Any], prompts: Sequence[str],
                     max_new_tokens: int = 32) -> Any:
    """Greedy answers of each distinct base model and each run to ``prompts`` (a DataFrame)."""
    import pandas as pd

    from workbench.serve.infer import load_chat_model

    if not prompts:
        raise WorkbenchError("no prompts to answer; pass prompts=['...', ...]")
    table: dict[str, list[Any]] = {"prompt": list(prompts)}
    bases = list(dict.fromkeys(j.spec.model.id for j in jobs))
    for base in bases:
        column = "base" if len(bases) == 1 else f"base {base}"
        table[column] = load_chat_model(base).generate(prompts, max_new_tokens=max_new_tokens)
    for job in jobs:
        table[job.id] = load_chat_model(job).generate(prompts, max_new_tokens=max_new_tokens)
    return pd.DataFrame(table)


def answers_html(df: Any) -> str:
    """The table as HTML; an ``image`` column's pictures drawn as thumbnails."""
    head = "".join(f"<th style='text-align:left'>{html.escape(str(c))}</th>" for c in df.columns)
    cell = "<td style='text-align:left;vertical-align:top;white-space:pre-wrap'>{}</td>"
    body = "".join(
        "<tr>" + "".join(cell.format(_pictures(v) if c == "image"
                                     else html.escape("" if v is None else str(v)))
                         for c, v in zip(df.columns, r)) + "</tr>"
        for r in df.itertuples(index=False))
    return f"<table style='font-size:12px'><tr>{head}</tr>{body}</table>"


def _pictures(refs: Sequence[str]) -> str:
    """Thumbnails of a row's pictures (paths, or ``data:`` URLs of their bytes); a picture that
    can no longer be read shows as its name."""
    from pathlib import Path

    from workbench.data.images import resolve_image
    from workbench.widgets.image_preview import thumbnail_url

    out = []
    for ref in refs:
        try:
            out.append(f"<img src='{thumbnail_url(resolve_image(ref, 'answers', Path('/')))}'>")
        except (OSError, ValueError):  # ImageDataError is a ValueError
            out.append(html.escape(ref[:80]))
    return "".join(out)


class AnswersView(W.VBox):
    """Answers side by side: from eval example files at once, or generated when asked."""

    def __init__(self, jobs: Sequence[Any]) -> None:
        self.jobs = list(jobs)
        self.table = W.HTML()
        self.status = W.HTML()
        self.button = W.Button(description="Generate answers", icon="comments",
                               tooltip="answer held-out prompts with the base model and each run "
                                       "(loads the models in this kernel)")
        self.button.on_click(lambda _b: self.generate())
        self.df = example_answers(self.jobs)
        if self.df is not None:
            self.table.value = answers_html(self.df)
            self.status.value = "<small>answers from the runs' evaluation examples</small>"
        super().__init__([W.HTML("<b>Answers side by side</b>"), self.button, self.status,
                          self.table])

    def generate(self, prompts: Sequence[str] | None = None, max_new_tokens: int = 32) -> Any:
        """Generate answers (base, each run) to ``prompts``; default: the shown or held-out ones."""
        if prompts is None:
            prompts = (list(self.df["prompt"]) if self.df is not None
                       else heldout_prompts(self.jobs[0]))
        self.button.disabled = True
        self.status.value = "<i>loading models and generating…</i>"
        try:
            self.df = generate_answers(self.jobs, prompts, max_new_tokens)
        except WorkbenchError as exc:
            self.status.value = f"<span style='color:#d62728'>{html.escape(str(exc))}</span>"
            return None
        finally:
            self.button.disabled = False
        self.status.value = "<small>generated greedily in this kernel</small>"
        self.table.value = answers_html(self.df)
        return self.df
