"""The asynchronous snapshot writer on its own (no training): what it writes is what training
held at the save, its hashes are those of the files, and the copies it reuses are never still
being written."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from workbench.train.async_snapshot import AsyncWriter


def _state() -> tuple[dict, dict]:
    torch.manual_seed(0)
    weights = {"a": torch.randn(64, 32), "b": torch.randn(7)}
    optim = {"state": {0: {"exp_avg": torch.randn(64, 32), "step": torch.tensor(1.0)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}
    return weights, optim


def _save(writer: AsyncWriter, folder: Path, weights: dict, optim: dict) -> None:
    folder.mkdir()
    with writer.capture():
        torch.save(optim, folder / "optimizer.pt")
        # through the module, as transformers does: the writer patches module attributes
        safetensors.torch.save_file(weights, str(folder / "model.safetensors"),
                                    metadata={"format": "pt"})


def test_files_hold_the_state_at_the_save_and_the_manifest_hashes(tmp_path):
    writer = AsyncWriter(0)
    weights, optim = _state()
    for step in range(3):  # the 2nd and 3rd saves copy into the buffers of the previous one
        folder = tmp_path / f"checkpoint-{step}"
        _save(writer, folder, weights, optim)
        expect_w, expect_m = weights["a"].clone(), optim["state"][0]["exp_avg"].clone()
        weights["a"].add_(1.0)  # training goes on, in place, while the thread writes
        optim["state"][0]["exp_avg"].mul_(2.0)
        writer.flush_async(folder)
        writer.wait()
        assert (folder / ".done-rank-0").is_file()
        for name in ("optimizer.pt", "model.safetensors"):
            data = (folder / name).read_bytes()
            assert writer.hashes[str(folder / name)] == (hashlib.sha256(data).hexdigest(),
                                                         len(data))
        assert torch.equal(load_file(str(folder / "model.safetensors"))["a"], expect_w)
        assert torch.equal(torch.load(folder / "optimizer.pt")["state"][0]["exp_avg"], expect_m)
        with safe_open(str(folder / "model.safetensors"), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}


def test_a_save_while_the_previous_one_is_written_copies_into_other_memory(tmp_path):
    writer = AsyncWriter(0)
    weights, optim = _state()
    _save(writer, tmp_path / "checkpoint-1", weights, optim)
    writer.flush_async(tmp_path / "checkpoint-1")
    writer.wait()
    recycled = {id(t) for bufs in writer._free.values() for t in bufs}
    assert recycled  # the first snapshot's copies, free once written

    _save(writer, tmp_path / "checkpoint-2", weights, optim)
    second = {id(t) for t in writer._held}
    assert second == recycled  # copied into them
    expect = weights["a"].clone()
    go = threading.Event()
    writer._jobs.insert(0, go.wait)  # the writer is held back before it writes checkpoint-2
    writer.flush_async(tmp_path / "checkpoint-2")
    weights["a"].add_(1.0)
    _save(writer, tmp_path / "checkpoint-3", weights, optim)
    assert not {id(t) for t in writer._held} & second
    go.set()
    writer.flush_async(tmp_path / "checkpoint-3")
    writer.wait()
    assert torch.equal(load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))["a"], expect)
    assert torch.equal(load_file(str(tmp_path / "checkpoint-3" / "model.safetensors"))["a"],
                       weights["a"])
