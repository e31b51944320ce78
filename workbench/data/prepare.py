"""Prepare a run's data before launch: read every source, normalise, split, write RUN_DIR/data.

Runs in the notebook (or CLI) process, so a bad row fails the launch cell with a precise error
instead of failing a remote job minutes later; the training processes then only tokenise the
prepared files, identically on every target.

    >>> summary = prepare_data(RunSpec(), out_dir)  # doctest: +SKIP
    >>> summary.counts
    {'train': 211, 'validation': 24}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.data.formats import detect_format, example_text, to_example
from workbench.data.sources import read_rows
from workbench.data.split import assign_split
from workbench.errors import EmptyDatasetError
from workbench.spec import DataSource, RunSpec


@dataclass
class DataSummary:
    counts: dict[str, int]
    per_source: list[dict[str, Any]] = field(default_factory=list)
    preview: list[dict[str, Any]] = field(default_factory=list)
    cleaning: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "per_source": self.per_source, "cleaning": self.cleaning}


def source_examples(source: DataSource) -> Iterator[dict[str, Any]]:
    """A source's rows as examples. "auto" is decided once, on the first row, so a later row
    missing a field is reported as missing it rather than as being of another format."""
    fmt: str = source.format
    for where, row in read_rows(source):
        if fmt == "auto":
            fmt = detect_format(row, where)
        yield to_example(row, fmt, where)


def preview_rows(source: DataSource, n: int = 5) -> list[dict[str, Any]]:
    """The first ``n`` examples of a source, normalised (for the run form's preview)."""
    out = []
    for ex in source_examples(source):
        out.append(ex)
        if len(out) >= n:
            break
    if not out:
        raise EmptyDatasetError(f"dataset {source.path!r} has no rows; give a non-empty file")
    return out


def _examples(spec: RunSpec, per_source: list[dict[str, Any]]):
    for source in spec.data.sources:
        n = 0
        for ex in source_examples(source):
            n += 1
            yield ex
        if n == 0:
            raise EmptyDatasetError(
                f"dataset {source.path!r} has no rows; give a non-empty file or remove the source"
            )
        per_source.append({"path": source.path, "rows": n})


# Joins an example's turns into one text for the cleaning steps and splits them back after; a
# visible symbol (not whitespace or a control character) so normalisation leaves it alone.
_TURN_SEP = "\n\u241e\n"


def _clean(examples: Iterator[dict[str, Any]], spec: RunSpec):
    from workbench.data.clean import CleanPipeline

    pipeline = CleanPipeline.from_spec(spec.data.clean)

    def flat():
        for ex in examples:
            turns = [ex["text"]] if "text" in ex else [m["content"] for m in ex["messages"]]
            yield {"text": _TURN_SEP.join(turns), "_example": ex}

    kept, report = pipeline.run(flat(), text_fields=["text"], source="data.sources")

    def rebuilt():
        for row in kept:
            ex, turns = row["_example"], [t.strip() for t in row["text"].split("\u241e")]
            if "text" in ex:
                yield {"text": turns[0]}
            elif len(turns) == len(ex["messages"]):
                yield {"messages": [{**m, "content": t} for m, t in zip(ex["messages"], turns)]}
            else:  # a step merged turns: keep the example as it was rather than misalign it
                yield ex

    return rebuilt(), report


def prepare_data(spec: RunSpec, out_dir: str | Path) -> DataSummary:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_source: list[dict[str, Any]] = []
    examples = _examples(spec, per_source)
    report = None
    if spec.data.clean.enabled:
        examples, report = _clean(examples, spec)
    counts = {"train": 0, "validation": 0}
    preview: list[dict[str, Any]] = []
    files = {s: (out / f"{s}.jsonl").open("w", encoding="utf-8") for s in counts}
    try:
        for ex in examples:
            side = assign_split(example_text(ex), spec.data.validation_fraction, spec.train.seed)
            files[side].write(json.dumps(ex, ensure_ascii=False) + "\n")
            counts[side] += 1
            if len(preview) < 5:
                preview.append(ex)
    finally:
        for fh in files.values():
            fh.close()
    if counts["train"] == 0:
        raise EmptyDatasetError(
            "no training examples are left"
            + (" after cleaning" if report is not None else "")
            + f" ({counts['validation']} went to validation); add data or lower "
            "data.validation_fraction"
        )
    cleaning = report.to_dict() if report is not None else None
    summary = DataSummary(counts=counts, per_source=per_source, preview=preview, cleaning=cleaning)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1), encoding="utf-8")
    return summary
