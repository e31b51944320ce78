"""The data step of a real launch: refusal before anything starts, tokenise once with a visible
preparing phase, the cache, resume, and both ranks reading the same Arrow files (2 processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

import workbench
from workbench.errors import DataTruncationError
from workbench.runs.home import runs_dir
from workbench.runs.registry import Registry

pytestmark = pytest.mark.slow


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _long_prompt_chat(i: int) -> dict:
    return {"messages": [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": f"Question {i}: " + "the quick brown fox jumps " * 40},
        {"role": "assistant", "content": "yes"}]}


def test_long_prompts_are_refused_before_anything_starts(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [_long_prompt_chat(i) for i in range(64)])
    before_runs, before_reg = set(runs_dir().iterdir()), len(Registry().list_runs())
    spec = {"name": "long", "data": {"sources": [{"path": str(path)}], "max_length": 64,
                                     "truncation": "right", "validation_fraction": 0.0}}
    with pytest.raises(DataTruncationError) as info:
        workbench.launch(spec)
    msg = str(info.value)
    assert "no training example has a response token left" in msg
    assert "0 of 64 training examples are truncated and 64 lose every response token" in msg
    assert "Raise data.max_length" in msg and "data.truncation: keep_response" in msg
    assert set(runs_dir().iterdir()) == before_runs
    assert len(Registry().list_runs()) == before_reg
    # Again: now from the tokenised cache (no tokenizer loaded), refused the same way.
    with pytest.raises(DataTruncationError) as again:
        workbench.launch(spec)
    assert str(again.value) == msg
    assert set(runs_dir().iterdir()) == before_runs


def test_a_launch_that_cuts_most_prompts_says_how_many_and_how_much(tmp_path, capfd):
    from workbench.data.tokenize import load_tokenizer
    from workbench.errors import DataTruncationWarning
    from workbench.spec import RunSpec
    from workbench.spec.models import resolve_model

    rows = [_long_prompt_chat(i) for i in range(64)]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    spec = RunSpec(name="cut", data={"sources": [{"path": str(path)}], "max_length": 64,
                                     "truncation": "keep_response", "validation_fraction": 0.0},
                   train={"max_steps": 1})
    with pytest.warns(DataTruncationWarning) as said:
        job = workbench.launch(spec)
    job.wait(timeout=600)
    [notice] = [str(w.message) for w in said if w.category is DataTruncationWarning]
    # The oracle: the chat template's own token counts, from transformers.
    tok = load_tokenizer(spec, resolve_model(spec.model.id))
    whole = sum(len(tok(tok.apply_chat_template(r["messages"], tokenize=False),
                        add_special_tokens=False)["input_ids"]) for r in rows)
    cut = round(100 * (whole - 64 * 64) / whole)
    assert notice.startswith("64 of 64 training examples are longer than data.max_length 64 "
                             "and are cut (prompt first"), notice
    assert any(f"losing {p}% of their tokens" in notice for p in (cut - 1, cut, cut + 1)), notice
    assert job.status()["notices"] == [notice]
    # The launch wrote the tokenised data without a library progress bar above the cell's output
    # ("Saving the dataset"), and left datasets' own switch as it was.
    import datasets

    assert "Saving the dataset" not in capfd.readouterr().err
    assert not datasets.are_progress_bars_disabled()


def _watch_phases(stop: threading.Event, seen: list) -> None:
    registry = Registry()
    while not stop.is_set():
        for record in registry.list_runs(5):
            try:
                summary = workbench.get_job(record.id).summary()
            except Exception:  # the row can vanish between list and read
                continue
            if summary.get("phase"):
                seen.append((record.id, summary["phase"]))
        time.sleep(0.05)


def _rank_lines(job, split="train") -> dict[str, str]:
    out = {}
    for name in ("rank-0.log", "rank-1.log"):
        text = (job.run_dir.logs_dir / name).read_text()
        out[name] = [ln for ln in text.splitlines() if ln.startswith(f"data: {split} ")]
    return out


def test_large_set_is_tokenised_once_cached_and_read_by_both_ranks(tmp_path):
    short = [{"instruction": f"Repeat the number {i}.", "output": str(i)} for i in range(20000)]
    long = [{"system": "Answer with one word.",
             "instruction": f"Case {i}: " + "the quick brown fox jumps " * 40, "output": "yes"}
            for i in range(5)]
    path = _write_jsonl(tmp_path / "big.jsonl", short + long)
    spec = {"name": "bigdata", "data": {"sources": [{"path": str(path)}], "max_length": 64},
            "train": {"max_steps": 3, "batch_size": 4}, "checkpoint": {"every_steps": 3}}
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch_phases, args=(stop, seen), daemon=True)
    watcher.start()
    try:
        first = workbench.launch(spec)
    finally:
        stop.set()
        watcher.join()
    phases = [p for rid, p in seen if rid == first.id]
    assert any(p.startswith("preparing train ") for p in phases), phases
    status = first.status()
    assert status["prepare"]["cache_hit"] is False
    stats = json.loads((first.run_dir.data_dir / "stats.json").read_text())
    train = stats["splits"]["train"]
    assert train["examples"] + stats["splits"]["validation"]["examples"] == 20005
    # The 5 long prompts (in whichever split their hash sent them) are truncated, and trained.
    assert train["truncated"] + stats["splits"]["validation"]["truncated"] == 5
    assert train["dropped"] == stats["splits"]["validation"]["dropped"] == 0
    assert train["tokens"]["max"] > 64 >= train["tokens"]["median"]
    assert first.wait(timeout=600, progress=False) == "succeeded", first.logs(tail=30)

    # Both ranks memory-mapped the same files that launch wrote; neither tokenised.
    tokenized = first.run_dir.data_dir / "tokenized" / "train"
    lines = _rank_lines(first)
    for name, found in lines.items():
        assert len(found) == 1 and str(tokenized) in found[0], (name, found)
        assert f"loaded {train['examples']} rows memory-mapped" in found[0]
    assert lines["rank-0.log"] == lines["rank-1.log"]
    # Each (standby) rank imported with the collector off (~1,200 collections with it on) and
    # then kept the imports' objects out of the collections that training makes.
    for name in ("rank-0.log", "rank-1.log"):
        gc_line = re.search(r"gc: (\d+) collections during the imports, (\d+) objects kept out",
                            (first.run_dir.logs_dir / name).read_text())
        assert gc_line and int(gc_line[1]) < 10 and int(gc_line[2]) > 100_000, (name, gc_line)
    val = _rank_lines(first, "validation")["rank-0.log"][0]
    assert f"loaded {stats['splits']['validation']['examples']} rows" in val

    # A second run on the same data and settings links the cache instead of tokenising, and
    # its launch (a fresh process, as the CLI's) never loads the tokenizer, transformers or torch.
    code = ("import json, sys, workbench\n"
            f"job = workbench.launch(json.loads({json.dumps({**spec, 'name': 'bigdata2'})!r}))\n"
            "print(job.id, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id, heavy = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert heavy == "[]", out.stdout
    second = workbench.get_job(run_id)
    assert second.status()["prepare"]["cache_hit"] is True
    assert second.status()["prepare"]["fingerprint"] == status["prepare"]["fingerprint"]
    files = sorted(p.relative_to(tokenized) for p in tokenized.rglob("*") if p.is_file())
    again = second.run_dir.data_dir / "tokenized" / "train"
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tokenized / rel).read_bytes() == (again / rel).read_bytes()
    assert second.wait(timeout=600, progress=False) == "succeeded", second.logs(tail=30)

    # A resume reads the run's own tokenised copy again (no re-tokenising, nothing rewritten).
    mtimes = {p: p.stat().st_mtime_ns for p in tokenized.rglob("*.arrow")}
    first.resume(**{"train.max_steps": 5})
    assert first.wait(timeout=600, progress=False) == "succeeded", first.logs(tail=30)
    after = _rank_lines(first)
    for found in after.values():
        assert len(found) == 2 and all("memory-mapped" in ln for ln in found), found
    assert {p: p.stat().st_mtime_ns for p in tokenized.rglob("*.arrow")} == mtimes
    assert "tokenised" not in (first.run_dir.logs_dir / "rank-0.log").read_text()
