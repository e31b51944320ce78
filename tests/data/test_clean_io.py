"""Files in and out: bad inputs become clear errors; the CLI; stable train/validation split."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from workbench.data import commands
from workbench.data.clean import CleanReport, clean_file, read_records
from workbench.data.clean.corpus import write_corpus
from workbench.data.split import split_file
from workbench.errors import DatasetError, DatasetFormatError, EmptyDatasetError


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data, error, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", DatasetError, r"bad.jsonl looks like a binary file"),
    ('{"text": "中文"}\n'.encode("gbk"), DatasetError,
     r"line 1 of bad.jsonl is not valid UTF-8 .*iconv -f GBK"),
    (b"", EmptyDatasetError, r"has no rows"),
    (b"\n  \n", EmptyDatasetError, r"has no rows"),
    (b'{"text": "a"}\n[1, 2]\n', DatasetFormatError,
     r'line 2 of bad.jsonl is not a JSON object \(got a list\); each line must be an object '
     r'with a "text" field'),
    (b'{"text": "a"}\n{"body": "b"}\n', DatasetFormatError,
     r'line 2 of bad.jsonl has no "text" field \(fields present: body\)'),
    (b'{"text": 3}\n', DatasetFormatError, r'field "text" is a number, expected a string'),
    (b'{"text": "a"\n', DatasetFormatError, r"line 1 of bad.jsonl is not valid JSON"),
])
def test_bad_inputs_are_clear_errors(tmp_path: Path, data: bytes, error: type,
                                     message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", data)
    with pytest.raises(error, match=message):
        list(read_records(path))
    with pytest.raises(error, match=message):
        clean_file(path, tmp_path / "out.jsonl", steps=["normalize"], workers=1, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        list(read_records(tmp_path / "nope.jsonl"))


def test_text_file_is_one_document_per_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.txt", b"first line here\n\nsecond line here\n")
    assert [r["text"] for r in read_records(path)] == ["first line here", "second line here"]


def test_cli_clean_and_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "raw.jsonl", 150, seed=2)
    parser = argparse.ArgumentParser(prog="workbench")
    commands.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "clean.jsonl"
    args = parser.parse_args(["data", "clean", str(tmp_path / "raw.jsonl"), str(out),
                              "--steps", "normalize,exact_dedup,pii", "--workers", "1",
                              "--quiet", "--report", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    report = CleanReport.load(tmp_path / "r.json")
    assert report.documents_in == corpus["documents"]
    assert report.documents_out == sum(1 for _ in out.open()) < corpus["documents"]
    assert "exact_dedup" in capsys.readouterr().out

    assert commands.main(["data", "split", str(out), str(tmp_path / "split"),
                          "--fraction", "0.2", "--seed", "1"]) == 0
    train = (tmp_path / "split" / "train.jsonl").read_text().splitlines()
    val = (tmp_path / "split" / "validation.jsonl").read_text().splitlines()
    assert len(train) + len(val) == report.documents_out and 0 < len(val) < len(train)


def test_cli_reports_errors_with_exit_code(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.jsonl", b"[1]\n")
    assert commands.main(["data", "clean", str(bad), str(tmp_path / "o.jsonl"), "--quiet"]) == 2
    assert "DatasetFormatError: line 1 of bad.jsonl" in capsys.readouterr().err
    assert commands.main(["data", "clean", str(bad), str(tmp_path / "o.jsonl"),
                          "--steps", "nope"]) == 2
    assert "unknown step 'nope'" in capsys.readouterr().err


def test_split_is_stable_when_data_is_appended(tmp_path: Path) -> None:
    write_corpus(tmp_path / "a.jsonl", 300, seed=4)
    split_file(tmp_path / "a.jsonl", tmp_path / "s1", fraction=0.1, seed=42)
    lines = (tmp_path / "a.jsonl").read_text()
    write_corpus(tmp_path / "more.jsonl", 200, seed=5)
    more = (tmp_path / "more.jsonl").read_text().replace('"id": "doc-', '"id": "new-')
    (tmp_path / "b.jsonl").write_text(lines + more)
    split_file(tmp_path / "b.jsonl", tmp_path / "s2", fraction=0.1, seed=42)

    def ids(folder: str, side: str) -> set[str]:
        path = tmp_path / folder / f"{side}.jsonl"
        return {json.loads(x)["id"] for x in path.read_text().splitlines()}

    assert ids("s1", "validation") <= ids("s2", "validation")
    assert ids("s1", "train") <= ids("s2", "train")
    assert not ids("s2", "validation") & ids("s1", "train")
    assert 10 <= len(ids("s1", "validation")) <= 55


def test_clean_file_writes_output_and_report(tmp_path: Path) -> None:
    # Hand-written rows whose fate is known in advance: what goes, why, and what is rewritten.
    river = "The river rises in the hills and runs west to the sea."
    raw = [
        {"id": 1, "text": river},
        {"id": 2, "text": "ok"},                                   # too short
        {"id": 3, "text": river},                                  # exact duplicate of 1
        {"id": 4, "text": "Write to jane.doe@example.org for the forms."},
        {"id": 5, "text": "  The   river rises in the hills\tand runs west to the sea. "},  # 1 again
        {"id": 6, "text": "Bread needs flour, water, salt and a little patience."},
    ]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    report = clean_file(tmp_path / "raw.jsonl", tmp_path / "out.jsonl", workers=2,
                        steps=["normalize", "length", "exact_dedup", "pii"], progress=False)
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 4, 6]  # input order, other fields kept
    assert rows[0]["text"] == river and rows[2]["text"] == raw[5]["text"]
    assert rows[1]["text"] == "Write to <EMAIL> for the forms."
    assert (report.documents_in, report.documents_out) == (6, 3)
    assert report.step("length").removed == 1 and report.step("exact_dedup").removed == 2
    assert report.step("pii").modified == 1
    saved = CleanReport.load(tmp_path / "out.jsonl.report.json")
    assert (saved.documents_in, saved.documents_out) == (6, 3)
    assert not (tmp_path / "out.jsonl.tmp").exists()
