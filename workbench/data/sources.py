"""Read rows from a data source: jsonl, json, csv, parquet, a `datasets` folder, a hub id, a built-in.

Rows are yielded one at a time as ``(where, row)`` where ``where`` names the file and line (or row
number) so that a format error can say exactly which row is wrong.

    >>> from workbench.spec.sections import DataSource
    >>> next(read_rows(DataSource(path="builtin:teaching")))[1]["output"]  # doctest: +SKIP
    'moo'
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from workbench.data.formats import map_columns
from workbench.errors import DatasetError, DatasetFormatError
from workbench.spec.sections import DataSource

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def read_rows(source: DataSource) -> Iterator[tuple[str, dict[str, Any]]]:
    """The source's rows, at most ``max_rows`` of them, with its ``columns`` named as the parts
    they play."""
    rows = _read_all(source)
    if source.max_rows is not None:
        rows = islice(rows, source.max_rows)
    if source.columns:
        columns = source.columns
        return ((where, map_columns(row, columns, where)) for where, row in rows)
    return rows


def _read_all(source: DataSource) -> Iterator[tuple[str, dict[str, Any]]]:
    spec_path = source.path
    if spec_path.startswith("builtin:"):
        from workbench.assets import builtin_dataset_path

        yield from _read_jsonl(builtin_dataset_path(spec_path, source.split))
        return
    path = Path(os.path.expanduser(spec_path))
    if path.is_dir():
        yield from _read_saved_dataset(path, source.split)
    elif path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise DatasetError(
                f"{path}: unsupported file type {path.suffix!r}; use one of "
                f"{', '.join(FILE_KINDS)} or a folder written by datasets' save_to_disk"
            )
        yield from {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv,
                    "parquet": _read_parquet}[kind](path)
    elif _HUB_ID.match(spec_path) and "/" in spec_path and not spec_path.startswith((".", "~")):
        yield from _read_hub(spec_path, source.split)
    else:
        raise DatasetError(
            f"dataset {spec_path!r} not found: no such file or folder on this machine, and not a "
            "hub id (ORG/NAME); fix data.sources[].path"
        )


def _check_text(path: Path) -> None:
    with path.open("rb") as fh:
        head = fh.read(4096)
    if b"\x00" in head:
        raise DatasetError(f"{path} looks like a binary file, not text; give a jsonl/csv file")


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    _check_text(path)
    with path.open("r", encoding="utf-8") as fh:
        lineno = 0
        while True:
            try:
                line = fh.readline()
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"line {lineno + 1} of {path.name} is not UTF-8 ({exc.reason}); re-encode the "
                    "file as UTF-8 (e.g. iconv -f GBK -t UTF-8)"
                ) from None
            if not line:
                break
            lineno += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(
                    f"line {lineno} of {path.name} is not valid JSON ({exc.msg}); each line must "
                    "be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DatasetFormatError(
                    f"line {lineno} of {path.name} is a JSON {type(row).__name__}, not an object; "
                    "each line must be one JSON object"
                )
            yield f"line {lineno} of {path.name}", row


def _read_json(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    _check_text(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"{path.name} is not a valid UTF-8 JSON file: {exc}") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise DatasetFormatError(f"{path.name}: expected a JSON list of objects")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DatasetFormatError(f"item {i} of {path.name} is not an object")
        yield f"item {i} of {path.name}", row


def _read_csv(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    _check_text(path)
    try:
        with path.open("r", encoding="utf-8", newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh)):
                yield f"line {i + 2} of {path.name}", dict(row)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path.name} is not UTF-8 ({exc.reason}); re-encode it") from None


def _read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise DatasetError(f"{path.name} is not a readable parquet file: {exc}") from None
    n = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield f"row {n} of {path.name}", row


def _read_saved_dataset(path: Path, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is a folder but not one written by datasets' save_to_disk; point "
            "data.sources[].path at a file or such a folder"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path} has splits {list(ds)}, not {split!r}; set the split")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"row {i + 1} of {path.name}", row


def _read_hub(dataset_id: str, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split, streaming=True)
    except Exception as exc:  # the hub raises many types; all mean "cannot get it"
        raise DatasetError(
            f"could not load dataset {dataset_id!r} from the hub: {exc}. Check the id and that "
            "the hub is reachable, or download it and point data.sources[].path at the file"
        ) from None
    for i, row in enumerate(ds):
        yield f"row {i + 1} of {dataset_id}", row
