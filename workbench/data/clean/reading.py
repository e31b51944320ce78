"""Streaming readers and writers for the files the cleaning CLI takes: JSON Lines and plain text.

Every bad input becomes a typed error naming the file, the line and what to do: binary files,
text that is not UTF-8, empty files, rows that are not JSON objects, rows without the text field.
Files are read one line at a time, so memory does not grow with the corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from workbench.errors import DatasetError, DatasetFormatError, EmptyDatasetError

TEXT_SUFFIXES = (".txt", ".text")


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def read_records(path: str | Path, text_fields: Sequence[str] = ("text",)) -> Iterator[dict]:
    """Yield the rows of a ``.jsonl`` file (or one ``{"text": line}`` per line of a ``.txt``).

    Raises DatasetError (missing file, binary or non-UTF-8 content), EmptyDatasetError (no rows)
    and DatasetFormatError (a row that is not an object or lacks one of ``text_fields``).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path} does not exist or is not a file; pass a .jsonl or .txt file")
    as_text = path.suffix.lower() in TEXT_SUFFIXES
    rows = 0
    with path.open("rb") as f:
        # Sniff the head like git does: a NUL byte in the first 8 KB means binary, whichever
        # line it is on (a PNG's first "line" is not valid UTF-8 before its first NUL).
        if b"\x00" in f.read(8192):
            raise DatasetError(f"{path.name} looks like a binary file (it contains NUL bytes); "
                               "pass a UTF-8 JSON Lines (.jsonl) or text (.txt) file")
        f.seek(0)
        for lineno, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                raise DatasetError(
                    f"{path.name} looks like a binary file (NUL byte on line {lineno}); "
                    "pass a UTF-8 JSON Lines (.jsonl) or text (.txt) file")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"line {lineno} of {path.name} is not valid UTF-8 (byte "
                    f"0x{raw[e.start]:02x} at column {e.start + 1}); convert the file first, "
                    f"e.g. `iconv -f GBK -t UTF-8 {path.name} > fixed.jsonl`") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # tolerate a UTF-8 byte-order mark
            if not line.strip():
                continue
            if as_text:
                row: Any = {text_fields[0]: line.rstrip("\r\n")}
            else:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetFormatError(
                        f"line {lineno} of {path.name} is not valid JSON ({e.msg} at column "
                        f"{e.colno}); each line must be one JSON object") from None
                check_row(row, text_fields, f"line {lineno} of {path.name}")
            rows += 1
            yield row
    if rows == 0:
        raise EmptyDatasetError(f"{path} has no rows (the file is empty or blank); "
                                "pass a file with at least one record")


def check_row(row: Any, text_fields: Sequence[str], where: str) -> None:
    """Raise DatasetFormatError unless ``row`` is a dict with a string in every text field."""
    fields = " and ".join(f'"{f}"' for f in text_fields)
    if not isinstance(row, dict):
        raise DatasetFormatError(
            f"{where} is not a JSON object (got {_kind(row)}); each line must be an object "
            f"with a {fields} field")
    for name in text_fields:
        if name not in row:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise DatasetFormatError(
                f'{where} has no "{name}" field (fields present: {present}); pass the right '
                "field with --text-field / text_fields=")
        if not isinstance(row[name], str):
            raise DatasetFormatError(
                f'{where}: field "{name}" is {_kind(row[name])}, expected a string')


def write_records(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows as JSON Lines (UTF-8, CJK kept readable); returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")
            n += 1
    return n
