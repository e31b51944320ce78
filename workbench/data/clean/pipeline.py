"""The cleaning pipeline: runs the steps over a stream of records on every core, in input order.

Records are read in batches; each batch's text fields go to a worker process that runs every
per-document step and computes the dedup keys (:func:`_process_one`). The parent consumes the results
in input order, asks each dedup step's index whether the key was seen before (so the first
occurrence is kept, whatever worker saw it; the near-dedup index also names the kept document and
the similarity that made a document a near-duplicate), writes the kept rows out and updates the
report. At most a few batches per worker are in flight, so memory stays bounded on any corpus size.

The per-document decision is exactly the one a sequential run would make: a worker stops at the
first per-document step that removes a document and reports the dedup keys of the dedup steps
before it; the parent checks those keys in step order and a duplicate wins over a later removal.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.data.clean.dedup import ExactDedup, NearDedup
from workbench.data.clean.langid import LanguageFilter
from workbench.data.clean.length import LengthFilter
from workbench.data.clean.near_index import NearDupIndex, NearMatch
from workbench.data.clean.normalize import Normalize
from workbench.data.clean.pii import PIIScrubber
from workbench.data.clean.quality import QualityFilter
from workbench.data.clean.reading import check_row, read_records, write_records
from workbench.data.clean.report import CleanReport
from workbench.data.clean.step import DedupStep, Doc, Step
from workbench.data.clean.toxicity import ToxicityFilter
from workbench.errors import SpecError

#: Every step, by the name RunSpec (``data.clean.steps``) and the CLI (``--steps``) use.
STEPS: dict[str, type[Step]] = {
    cls.name: cls
    for cls in (Normalize, LengthFilter, LanguageFilter, ExactDedup, QualityFilter,
                ToxicityFilter, NearDedup, PIIScrubber)
}
#: The default pipeline, in order: language ID -> exact dedup -> quality -> toxicity -> near
#: dedup -> PII, with normalisation and the cheap length filter first.
DEFAULT_STEPS: tuple[str, ...] = ("normalize", "length", "langid", "exact_dedup", "quality",
                                  "toxicity", "near_dedup", "pii")


def build_steps(names: Sequence[str] | None = None,
                options: Mapping[str, Mapping[str, Any]] | None = None,
                *, field_prefix: str = "data.clean") -> list[Step]:
    """Instantiate steps by name with per-step options; every problem becomes one SpecError.

    >>> [s.name for s in build_steps(["normalize", "pii"])]
    ['normalize', 'pii']
    """
    names = list(DEFAULT_STEPS if names is None else names)
    options = dict(options or {})
    known = ", ".join(STEPS)
    problems: list[tuple[str, str]] = []
    for i, name in enumerate(names):
        if name not in STEPS:
            problems.append((f"{field_prefix}.steps", f"unknown step {name!r}; known: {known}"))
        elif name in names[:i]:
            problems.append((f"{field_prefix}.steps", f"step {name!r} is listed twice"))
    for name in options:
        if name not in STEPS:
            problems.append((f"{field_prefix}.options",
                             f"options for unknown step {name!r}; known: {known}"))
        elif name not in names:
            problems.append((f"{field_prefix}.options.{name}",
                             f"options given for step {name!r}, which is not in the steps list"))
    steps: list[Step] = []
    for name in names:
        cls = STEPS.get(name)
        if cls is None:
            continue
        opts = dict(options.get(name) or {})
        allowed = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        bad = [k for k in opts if k not in allowed]
        if bad:
            problems.append((f"{field_prefix}.options.{name}",
                             f"unknown option(s) {', '.join(map(repr, bad))}; "
                             f"known: {', '.join(allowed) or 'none'}"))
            continue
        try:
            steps.append(cls(**opts))
        except (ValueError, TypeError) as e:
            problems.append((f"{field_prefix}.options.{name}", str(e)))
    if problems:
        raise SpecError(problems)
    return steps


# ---- worker side -------------------------------------------------------------------------------

_WORKER_STEPS: list[Step] = []

# What a worker sends back per document (a plain tuple: cheap to pickle).
#   (new_texts or None, index of the removing step or -1, reason, detail,
#    [(dedup step index, key)], language, [indices of steps that rewrote text], counters)
Result = tuple[dict | None, int, str | None, str, list, str | None, list[int], dict[str, int]]


def _init_worker(steps: list[Step]) -> None:
    global _WORKER_STEPS
    _WORKER_STEPS = steps


def _process_one(steps: Sequence[Step], texts: dict[str, str]) -> Result:
    doc = Doc(texts)
    keys: list[tuple[int, Any]] = []
    modified: list[int] = []
    for i, step in enumerate(steps):
        if isinstance(step, DedupStep):
            keys.append((i, step.key(doc)))
            continue
        before = doc.texts
        reason = step.apply(doc)
        if reason is not None:
            return None, i, reason, doc.detail, keys, doc.lang, modified, doc.counters
        if doc.texts is not before:
            modified.append(i)
    new = doc.texts if modified else None
    return new, -1, None, "", keys, doc.lang, modified, doc.counters


def _process_batch(batch: list[dict[str, str]]) -> list[Result]:
    return [_process_one(_WORKER_STEPS, texts) for texts in batch]


# ---- parent side -------------------------------------------------------------------------------


class CleanPipeline:
    """An ordered list of cleaning steps, run over records with :meth:`run`.

    >>> rows, report = CleanPipeline.from_names(["normalize", "exact_dedup"], workers=1,
    ...                                         progress=False).run(
    ...     [{"text": "a  b"}, {"text": "a b"}, {"text": "c"}])
    >>> [r["text"] for r in rows], report.documents_out
    (['a b', 'c'], 2)
    """

    def __init__(self, steps: Sequence[Step] | None = None, *, workers: int | None = None,
                 batch_size: int = 64, progress: bool = True, examples: int = 3) -> None:
        self.steps: list[Step] = list(steps) if steps is not None else build_steps()
        self.workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
        self.batch_size = batch_size
        self.progress = progress
        self.examples = examples

    @classmethod
    def from_names(cls, names: Sequence[str] | None = None,
                   options: Mapping[str, Mapping[str, Any]] | None = None,
                   **kwargs: Any) -> CleanPipeline:
        """Build from step names (None: the default pipeline) and per-step options."""
        return cls(build_steps(names, options), **kwargs)

    @classmethod
    def from_spec(cls, spec: Any, **kwargs: Any) -> CleanPipeline:
        """Build from a :class:`workbench.spec.CleanSpec` (``spec.data.clean``)."""
        return cls(build_steps(spec.steps, spec.options), **kwargs)

    @property
    def step_names(self) -> list[str]:
        return [s.name for s in self.steps]

    def run(self, records: Iterable[Mapping[str, Any]], text_fields: Sequence[str] = ("text",),
            *, source: str = "records") -> tuple[Iterator[dict], CleanReport]:
        """Clean ``records`` lazily: returns (iterator of kept rows, report).

        Kept rows are copies of the input rows with their ``text_fields`` rewritten by the
        rewriting steps (normalize, pii); other fields pass through. The report fills in as the
        iterator is consumed and is complete (``report.complete``) once it is exhausted.
        Raises DatasetFormatError on a row that is not a dict or lacks a text field.
        """
        text_fields = list(text_fields)
        report = CleanReport.start(self.steps, text_fields, source, self.workers,
                                   self.examples)
        return self._iterate(records, text_fields, report), report

    def _batches(self, records: Iterable[Mapping[str, Any]], text_fields: list[str]
                 ) -> Iterator[tuple[list[Mapping[str, Any]], list[dict[str, str]]]]:
        rows: list[Mapping[str, Any]] = []
        texts: list[dict[str, str]] = []
        for n, row in enumerate(records, start=1):
            check_row(row, text_fields, f"row {n}")
            rows.append(row)
            texts.append({f: row[f] for f in text_fields})
            if len(rows) >= self.batch_size:
                yield rows, texts
                rows, texts = [], []
        if rows:
            yield rows, texts

    def _results(self, batches: Iterator[tuple[list, list[dict[str, str]]]]
                 ) -> Iterator[tuple[list, list[Result]]]:
        if self.workers <= 1:
            for rows, texts in batches:
                yield rows, [_process_one(self.steps, t) for t in texts]
            return
        # fork shares the loaded modules with the workers; spawn where fork does not exist.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(self.workers, initializer=_init_worker, initargs=(self.steps,)) as pool:
            pending: deque = deque()
            for rows, texts in batches:
                pending.append((rows, pool.apply_async(_process_batch, (texts,))))
                # Bounded look-ahead keeps every worker busy without reading the whole input.
                if len(pending) >= 3 * self.workers:
                    rows0, fut = pending.popleft()
                    yield rows0, fut.get()
            while pending:
                rows0, fut = pending.popleft()
                yield rows0, fut.get()

    def _iterate(self, records: Iterable[Mapping[str, Any]], text_fields: list[str],
                 report: CleanReport) -> Iterator[dict]:
        from tqdm.auto import tqdm

        indexes = {i: s.new_index() for i, s in enumerate(self.steps)
                   if isinstance(s, DedupStep)}
        lang_field = next((s.field for s in self.steps
                           if isinstance(s, LanguageFilter) and s.field), None)
        started = time.perf_counter()
        bar = tqdm(desc="cleaning", unit=" docs", disable=not self.progress, mininterval=0.5)
        n = 0
        try:
            for rows, results in self._results(self._batches(records, text_fields)):
                for row, res in zip(rows, results, strict=True):
                    n += 1
                    new, failed, reason, detail, keys, lang, modified, counters = res
                    removed_at = failed
                    text = "\n\n".join(row[f] for f in text_fields)
                    match: NearMatch | None = None
                    for i, key in keys:
                        index = indexes[i]
                        if isinstance(index, NearDupIndex):
                            match = index.check(key, n)
                            if match is None:
                                report.record_indexed(i, n, text)
                                continue
                            detail = (f"near-duplicate of row {match.kept_row} (Jaccard "
                                      f"{match.similarity:.2f}, {match.method})")
                        elif index.seen(key):
                            detail = "same as an earlier document" if isinstance(
                                self.steps[i], ExactDedup) else "duplicate of an earlier one"
                        else:
                            continue
                        removed_at, reason = i, "duplicate"
                        break
                    if removed_at >= 0:
                        report.record_removed(removed_at, str(reason), detail, text, lang,
                                              [m for m in modified if m < removed_at],
                                              row=n, match=match)
                        continue
                    out = dict(row)
                    if new is not None:
                        out.update(new)
                    if lang_field is not None and lang is not None:
                        out[lang_field] = lang
                    report.record_kept(text, "\n\n".join(out[f] for f in text_fields), lang,
                                       modified, counters)
                    yield out
                bar.update(len(rows))
        finally:
            bar.close()
            report.finish(time.perf_counter() - started)


def clean_records(records: Iterable[Mapping[str, Any]], text_fields: Sequence[str] = ("text",),
                  steps: Sequence[str] | None = None,
                  options: Mapping[str, Mapping[str, Any]] | None = None,
                  **kwargs: Any) -> tuple[list[dict], CleanReport]:
    """Clean in-memory records eagerly: (kept rows, complete report). For small data."""
    rows, report = CleanPipeline.from_names(steps, options, **kwargs).run(records, text_fields)
    return list(rows), report


def clean_file(in_path: str | Path, out_path: str | Path, *,
               steps: Sequence[str] | None = None,
               options: Mapping[str, Mapping[str, Any]] | None = None,
               text_fields: Sequence[str] = ("text",), report_path: str | Path | None = None,
               **kwargs: Any) -> CleanReport:
    """Stream ``in_path`` (.jsonl or .txt) through the pipeline into ``out_path`` (.jsonl).

    Writes the report as JSON to ``report_path`` (default: ``<out_path>.report.json``) and
    returns it.
    """
    pipeline = CleanPipeline.from_names(steps, options, **kwargs)
    rows, report = pipeline.run(read_records(in_path, text_fields), text_fields,
                                source=str(in_path))
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    write_records(tmp, rows)
    tmp.replace(out_path)  # a crash never leaves a half-written output behind
    report.to_json(report_path or out_path.with_name(out_path.name + ".report.json"))
    return report
