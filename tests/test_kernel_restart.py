"""A run started from a notebook outlives a kernel restart and is found again by name; the same
run tracks to W&B for real.

A real IPython kernel driven by nbclient (as a notebook front end drives it): one cell launches
a run of the built-in tiny model (2 processes), the kernel is restarted while the run trains, and
a cell in the fresh kernel finds the run with ``workbench.get_job(name)`` and waits for it to
succeed. The run has ``tracking.wandb: offline`` (no network: W&B writes its run files under the
run directory); a second test reads the run's ``.wandb`` log back and compares its history with
metrics.jsonl. One run serves both: each real run costs ~30 s of the suite.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

import workbench
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

# The run holds after its first step until the kernel's restart is over (a hold file: HOLD_ENV),
# so it outlasts the restart on a machine of any speed.
STEPS, LR = 12, 3e-3


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """The run, launched from a kernel that is restarted mid-run; what the fresh kernel printed."""
    from workbench.train.callbacks import HOLD_ENV

    hold = tmp_path_factory.mktemp("hold") / "hold"
    hold.write_text("1")
    os.environ[HOLD_ENV] = str(hold)  # the kernel, and the run it launches, take it from here
    try:
        return _restart_while_it_trains(hold)
    finally:
        os.environ.pop(HOLD_ENV)
        hold.unlink(missing_ok=True)


def _restart_while_it_trains(hold: Path):
    name = f"restart-{secrets.token_hex(3)}"
    launch = nbformat.v4.new_code_cell(
        "import workbench\n"
        f"job = workbench.launch({{'name': '{name}', 'train': {{'max_steps': {STEPS}, "
        f"'log_every': 1, 'lr': {LR}}}, 'data': {{'validation_fraction': 0.0}}, "
        "'tracking': {'wandb': 'offline'}})\n"
        "print(job.id)")
    find = nbformat.v4.new_code_cell(
        "import workbench\n"
        f"again = workbench.get_job('{name}')\n"
        "print(again.id, again.wait(timeout=600, progress=False))")
    nb = nbformat.v4.new_notebook(cells=[launch, find])
    client = NotebookClient(nb, kernel_name="python3", timeout=600)
    with client.setup_kernel():
        client.execute_cell(launch, 0)
        run_id = _stdout(launch).strip()
        job = workbench.get_job(run_id)
        assert job.name == name
        wait_for(lambda: any("loss" in m for m in job.metrics()), 300, "a first training step",
                 every=0.05)
        old_kernel = client.km.provisioner.process.pid
        run_sync(client.km.restart_kernel)(now=True)  # what the notebook's Restart does
        assert client.km.provisioner.process.pid != old_kernel
        assert not psutil.pid_exists(old_kernel) or psutil.Process(old_kernel).status() == \
            psutil.STATUS_ZOMBIE
        gone = time.time()
        hold.unlink()  # the run, held after its first step, trains on

        def trained_on() -> bool:  # the kernel that launched it is gone; the run trains on
            ended = job.state != "running"  # read before the metrics: it may end in between
            if any("loss" in m and m["time"] > gone for m in job.metrics()):
                return True
            assert not ended, f"the run ended {job.state} before the kernel's restart was over"
            return False

        wait_for(trained_on, 300, "a step logged after the kernel's restart")
        run_sync(client.kc.wait_for_ready)(timeout=120)
        client.execute_cell(find, 1)
    return job, _stdout(find)


def test_a_run_outlives_a_kernel_restart_and_is_found_again_by_name(restarted):
    job, found = restarted
    found_id, state = found.split()
    assert found_id == job.id and state == "succeeded", found
    steps = [m["step"] for m in job.metrics() if "loss" in m]
    assert steps == list(range(1, STEPS + 1))  # one attempt, not restarted with the kernel
    assert not job.status().get("restarts")


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


def test_wandb_offline_history_holds_the_losses_of_metrics_jsonl(restarted):
    job, _ = restarted
    assert job.state == "succeeded", job.logs(tail=30)
    ours = {m["step"]: m["loss"] for m in job.metrics() if "loss" in m}
    assert sorted(ours) == list(range(1, STEPS + 1))
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
    assert config.get("learning_rate") == pytest.approx(LR)
