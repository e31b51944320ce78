"""eval.jsonl: the record every scorer writes and every view reads (workbench.evaluate.results)."""

import pytest

from workbench.evaluate import results


def test_lines_round_trip_and_newest_value_wins(tmp_path):
    results.append(tmp_path, results.record("heldout", {"rouge_l": 0.2}, phase="before", step=0,
                                            n=8, model="base"))
    results.append(tmp_path, results.record("heldout", {"rouge_l": 0.5, "bleu": 12}, phase="after",
                                            step=40, n=8))
    # A scorer killed mid-write leaves half a line: readers keep the complete ones.
    with (tmp_path / "eval.jsonl").open("a") as fh:
        fh.write('{"time": 1, "phase": "dur')
    lines = results.read(tmp_path)
    assert [(ln["phase"], ln["step"], ln["model"]) for ln in lines] == [("before", 0, "base"),
                                                                        ("after", 40, "run")]
    assert results.flat(lines) == {"heldout.rouge_l": 0.5, "heldout.bleu": 12.0}


def test_bad_lines_are_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="phase"):
        results.record("heldout", {"rouge_l": 0.2}, phase="later", step=0, n=1)
    with pytest.raises(ValueError, match="numbers"):
        results.record("heldout", {"rouge_l": "high"}, phase="after", step=0, n=1)
    assert results.read(tmp_path) == []
