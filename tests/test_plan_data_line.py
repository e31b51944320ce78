"""A plan of data it cannot read still comes out, and its data line says why in one line (the data
error's own message), instead of silently lacking the token statistics."""

from __future__ import annotations

import pytest

from workbench.plan import plan
from workbench.spec import RunSpec


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)


def _data_line(path: str) -> str:
    p = plan(RunSpec.parse({"data": {"sources": [{"path": path}]}, "train": {"max_steps": 10}}))
    assert p.data_tokens is None  # nothing was tokenised...
    lines = [line for line in p.summary().splitlines() if line.startswith("Data: ")]
    assert len(lines) == 1, p.summary()  # ...and the reason is on the one data line
    return lines[0]


def test_a_missing_data_file_is_named_on_the_data_line():
    line = _data_line("nowhere.jsonl")
    assert ("; reading it failed: dataset 'nowhere.jsonl' not found: no such file or folder on "
            "this machine, and not a hub id (ORG/NAME); fix data.sources[].path;") in line


def test_a_file_of_unknown_columns_says_which_columns_and_how_to_map_them(tmp_path):
    (tmp_path / "qa.csv").write_text("question,answer\nWhat is 2+2?,4\n", encoding="utf-8")
    line = _data_line("qa.csv")
    assert ("; reading it failed: line 2 of qa.csv: cannot tell the format from its columns "
            "['answer', 'question']; name the parts of your columns in data.sources[].columns, "
            "e.g. columns: {prompt: question, response: answer}.") in line


def test_readable_data_has_no_failure_on_its_line(tmp_path):
    (tmp_path / "ok.jsonl").write_text(
        '{"instruction": "Say hi", "input": "", "output": "hi"}\n' * 8, encoding="utf-8")
    p = plan(RunSpec.parse({"data": {"sources": [{"path": "ok.jsonl"}]},
                            "train": {"max_steps": 10}}))
    assert p.data_tokens is not None and "reading it failed" not in p.data_note
