"""Experiment tracking for real: W&B in offline mode records the run's losses as metrics.jsonl has them.

A real 2-process run of the built-in tiny model with ``tracking.wandb: offline`` (no network: W&B
writes its run files under the run directory); the test reads the run's ``.wandb`` log back and
compares its history with metrics.jsonl.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import workbench

pytestmark = pytest.mark.slow

# The .wandb file is a LevelDB-style record log (wandb's datastore format): a 7-byte file header
# (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header
# (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a
# header is padding. Every record is a wandb_internal_pb2.Record. wandb 0.2x dropped its Python
# reader (the Go core reads it now), so the few lines that walk the chunks live here.
_BLOCK, _HEADER = 32 * 1024, 7


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # padding at the end of a block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:  # zeros past the last record
            break
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _history(run_file: Path) -> list[dict]:
    rows = []
    for record in _records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def test_wandb_offline_history_holds_the_losses_of_metrics_jsonl():
    job = workbench.launch({"name": "wandb-offline",
                            "train": {"max_steps": 6, "log_every": 1, "lr": 3e-3},
                            "data": {"validation_fraction": 0.0},
                            "tracking": {"wandb": "offline"}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    ours = {m["step"]: m["loss"] for m in job.metrics() if "loss" in m}
    assert sorted(ours) == [1, 2, 3, 4, 5, 6]
    # One offline W&B run, written by rank 0 only, inside the run directory.
    runs = sorted((job.run_dir.path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history = [r for r in _history(runs[0]) if "train/loss" in r]
    theirs = {r["train/global_step"]: r["train/loss"] for r in history}
    assert sorted(theirs) == sorted(ours)
    for step, loss in ours.items():
        assert theirs[step] == pytest.approx(loss, rel=1e-4, abs=1e-4), (step, theirs, ours)
    # The run's config reached W&B too: the learning rate the spec set.
    config = {}
    for record in _records(runs[0]):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
    assert config.get("learning_rate") == pytest.approx(3e-3)
