"""Prepare a run's data before launch: read every source, normalise, split, write RUN_DIR/data.

Runs in the notebook (or CLI) process, so a bad row fails the launch cell with a precise error
instead of failing a remote job minutes later; the training processes then only tokenise the
prepared files, identically on every target.

The prepared files are cached under ``WORKBENCH_HOME/cache/prepared/KEY``, KEY being the bytes
of every local source file plus the settings that shape the result (format, split, max_rows,
cleaning, validation_fraction, seed): a later launch on the same data links them instead of
reading, cleaning and splitting every row again. A hub source has no cheap key: never cached.

    >>> summary = prepare_data(RunSpec(), out_dir)  # doctest: +SKIP
    >>> summary.counts
    {'train': 211, 'validation': 24}
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.data.formats import detect_format, example_text, to_example
from workbench.data.sources import read_rows
from workbench.data.split import assign_split
from workbench.errors import EmptyDatasetError
from workbench.spec import RunSpec
from workbench.spec.sections import DataSource


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


_KEY_VERSION = "1"  # bump when reading, cleaning or splitting changes what is written
_FILES = ("train.jsonl", "validation.jsonl", "summary.json", "preview.json")


def _hash_file(h: Any, path: Path) -> None:
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)


def sources_key(spec: RunSpec) -> str | None:
    """A key for what prepare_data writes from ``spec``'s sources, from their bytes (hashing is
    ~50x cheaper than parsing); None when a source is not a local file or folder (a hub id)."""
    from workbench._version import __version__

    h = hashlib.sha256(f"prepared v{_KEY_VERSION} {__version__}".encode())
    for source in spec.data.sources:
        if source.path.startswith("builtin:"):
            from workbench.assets import builtin_dataset_path

            path = Path(builtin_dataset_path(source.path, source.split))
        else:
            path = Path(os.path.expanduser(source.path))
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            return None
        h.update(json.dumps(source.model_dump(mode="json"), sort_keys=True).encode())
        for f in files:
            h.update(f"\0{f.relative_to(path)}\0".encode())
            _hash_file(h, f)
    h.update(json.dumps([spec.data.clean.model_dump(mode="json"), spec.data.validation_fraction,
                         spec.train.seed], sort_keys=True).encode())
    return h.hexdigest()[:24]


def _cache_dir() -> Path:
    from workbench.runs.home import home

    return home() / "cache" / "prepared"


def prepare_data(spec: RunSpec, out_dir: str | Path, cache: bool = False) -> DataSummary:
    """Write ``out_dir``/{train,validation}.jsonl and summary.json. With ``cache``, reuse (hard
    links) what an earlier call wrote from the same sources and settings, and store a new one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = sources_key(spec) if cache else None
    entry = _cache_dir() / key if key else None
    if entry is not None and (entry / "preview.json").is_file():
        for name in _FILES[:3]:
            _link(entry / name, out / name)
        saved = json.loads((entry / "summary.json").read_text(encoding="utf-8"))
        return DataSummary(counts=saved["counts"], per_source=saved["per_source"],
                           cleaning=saved["cleaning"],
                           preview=json.loads((entry / "preview.json").read_text("utf-8")))
    summary = _prepare(spec, out)
    if entry is not None:
        (out / "preview.json").write_text(json.dumps(summary.preview), encoding="utf-8")
        _store(out, entry)
        (out / "preview.json").unlink()
    return summary


def _link(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _store(out: Path, entry: Path) -> None:
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for name in _FILES:
            _link(out / name, tmp / name)
        tmp.rename(entry)  # atomic: a reader sees a complete entry or none
    except OSError:  # another launch stored the same key first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare(spec: RunSpec, out: Path) -> DataSummary:
    per_source: list[dict[str, Any]] = []
    examples = _examples(spec, per_source)
    report = None
    if spec.data.clean.enabled:
        examples, report = _clean(examples, spec)
    counts = {"train": 0, "validation": 0}
    preview: list[dict[str, Any]] = []
    for name in _FILES:  # never write through a hard link into the cache
        (out / name).unlink(missing_ok=True)
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
