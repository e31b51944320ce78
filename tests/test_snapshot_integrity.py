"""Snapshots stay true under the conditions a long run meets: an upload slower than the
snapshots, a write, commit or upload that fails, ranks on other nodes, many ranks starting at
once. Real files, a real storage folder reached through fsspec, real gloo processes and the real
Trainer on the built-in tiny model (in this process, one rank)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from workbench.runs.rundir import RunDir
from workbench.runs.snapshots import (
    MANIFEST,
    SnapshotError,
    Uploader,
    commit,
    newest_verified,
    snapshots,
    verify,
)
from workbench.spec import RunSpec
from workbench.train.async_snapshot import wait_for_ranks


def _trainer_checkpoint(rd: RunDir, step: int) -> Path:
    """What the Trainer leaves before a commit: checkpoint-N with a few files."""
    folder = rd.path / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "optimizer.pt", "trainer_state.json"):
        (folder / name).write_bytes(os.urandom(4096) + str(step).encode())
    return folder


def _poll(condition, timeout: float = 60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class HeldStorage(LocalFileSystem):
    """A storage folder whose copies of step-10 wait until the test lets them through: an
    upload that is slow for as long as the test needs, without sleeping."""

    protocol = ("heldstorage",)
    started = threading.Event()
    release = threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path.removeprefix("heldstorage://"))

    def put_file(self, lpath, rpath, *args, **kwargs):
        if "/step-10/" in str(rpath):
            HeldStorage.started.set()
            assert HeldStorage.release.wait(60)
        return super().put_file(lpath, rpath, *args, **kwargs)


fsspec.register_implementation("heldstorage", HeldStorage, clobber=True)


@pytest.fixture
def rd(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").create(RunSpec())


def test_a_snapshot_is_not_pruned_while_it_is_uploaded_and_is_once_it_is(rd, tmp_path):
    HeldStorage.started.clear()
    HeldStorage.release.clear()
    store = tmp_path / "store"
    uploader = Uploader(rd, f"heldstorage://{store}", keep=1)
    commit(rd, _trainer_checkpoint(rd, 10), 10, keep=1, uploader=uploader)
    assert HeldStorage.started.wait(60)  # step-10 is being copied...
    commit(rd, _trainer_checkpoint(rd, 20), 20, keep=1, uploader=uploader)  # ...keep=1
    assert [p.name for p in snapshots(rd)] == ["step-20", "step-10"]
    HeldStorage.release.set()
    uploader.close()
    # Both reached the storage whole, then the local copy went down to keep=1.
    for name in ("step-10", "step-20"):
        assert verify(store / name) is None, name
    assert (store / "latest").read_text().strip() == "step-20"
    assert rd.status()["upload"]["state"] == "uploaded"
    assert [p.name for p in snapshots(rd)] == ["step-20"]
    assert "snapshot_error" not in rd.status() or rd.status()["snapshot_error"] is None


def test_a_failed_upload_shows_in_status_until_an_upload_gets_through(rd, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the storage folder should be")
    uploader = Uploader(rd, str(blocker / "store"), keep=2)
    commit(rd, _trainer_checkpoint(rd, 10), 10, keep=2, uploader=uploader)
    assert _poll(lambda: (rd.status().get("snapshot_error") or {}).get("step") == 10)
    err = rd.status()["snapshot_error"]
    assert err["stage"] == "upload" and "not-a-folder" in err["error"]
    assert rd.status()["upload"]["state"] == "failed"
    blocker.unlink()  # the storage is back
    commit(rd, _trainer_checkpoint(rd, 20), 20, keep=2, uploader=uploader)
    uploader.close()
    assert rd.status()["upload"]["state"] == "uploaded"
    assert rd.status().get("snapshot_error") is None
    assert verify(blocker / "store" / "step-20") is None


def test_a_snapshot_whose_upload_a_crash_cut_short_is_uploaded_by_the_next_attempt(rd, tmp_path):
    store = tmp_path / "store"
    first = Uploader(rd, str(store), keep=3)
    commit(rd, _trainer_checkpoint(rd, 10), 10, keep=3, uploader=first)
    first.close()
    # The attempt dies right after committing step-20, before its uploader got to it.
    commit(rd, _trainer_checkpoint(rd, 20), 20, keep=3)
    assert (store / "latest").read_text().strip() == "step-10"
    second = Uploader(rd, str(store), keep=3)  # the next attempt, at start
    second.catch_up(snapshots(rd)[0])
    second.close()
    assert verify(store / "step-20") is None
    assert (store / "latest").read_text().strip() == "step-20"
    # Storage already has it: a third start copies nothing again.
    before = {p: p.stat().st_mtime_ns for p in (store / "step-20").rglob("*")}
    third = Uploader(rd, str(store), keep=3)
    third.catch_up(snapshots(rd)[0])
    third.close()
    assert {p: p.stat().st_mtime_ns for p in (store / "step-20").rglob("*")} == before


def _write_marker(folder: str, rank: int, text: str, go: str) -> None:
    """Another rank's process: waits for the test's go-ahead, then drops its marker."""
    while not Path(go).exists():
        time.sleep(0.01)
    Path(folder, f".{text}-rank-{rank}").write_text("ok" if text == "done" else text)


def test_the_wait_covers_every_rank_of_the_world_written_by_other_processes(tmp_path):
    folder, go = tmp_path / "checkpoint-5", tmp_path / "go"
    folder.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_marker, args=(str(folder), r, "done", str(go)))
             for r in (1, 2, 3)]
    for p in procs:
        p.start()
    (folder / ".done-rank-0").write_text("ok")
    waited = threading.Thread(target=wait_for_ranks, args=(folder, range(4), 120))
    waited.start()
    assert _poll(lambda: not waited.is_alive(), 1.0) is False  # ranks 1-3 have not written
    go.write_text("")
    waited.join(120)
    for p in procs:
        p.join(60)
    assert not waited.is_alive()
    assert not list(folder.glob(".done-rank-*"))  # consumed


def test_a_rank_that_could_not_write_fails_the_wait_at_once_with_its_reason(tmp_path):
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / ".done-rank-0").write_text("ok")
    (folder / ".failed-rank-1").write_text("OSError(28, 'No space left on device')")
    t0 = time.time()
    with pytest.raises(SnapshotError, match="rank 1 .*No space left on device"):
        wait_for_ranks(folder, range(2), timeout=600)
    assert time.time() - t0 < 60
    quiet = tmp_path / "checkpoint-6"
    quiet.mkdir()
    (quiet / ".done-rank-0").write_text("ok")
    with pytest.raises(SnapshotError, match=r"rank\(s\) 1 did not finish writing checkpoint-6"):
        wait_for_ranks(quiet, range(2), timeout=0.2)


# -- start-up: one verification for the whole world --------------------------------------------

def _resume_on_rank(rank: int, store: str, run_dir: str, out) -> None:
    import torch.distributed as dist

    import workbench.runs.snapshots as snaps

    hashed: list[str] = []
    real = snaps.sha256_file

    def counting(path):
        hashed.append(str(path))
        return real(path)

    snaps.sha256_file = counting
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        found = snaps.agreed_resume_point(RunDir(run_dir))
    finally:
        dist.destroy_process_group()
    out.put((rank, found.name if found else None, len(hashed)))


def _hand_made_snapshot(rd: RunDir, step: int, files: int) -> None:
    folder = rd.path / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    meta = {}
    for i in range(files):
        data = os.urandom(1 << 16)
        (folder / f"part-{i}.bin").write_bytes(data)
        meta[f"part-{i}.bin"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": meta}))


def test_ranks_starting_together_hash_each_snapshot_once_and_agree(rd, tmp_path):
    _hand_made_snapshot(rd, 10, files=3)
    _hand_made_snapshot(rd, 20, files=3)
    (rd.path / "checkpoints" / "step-20" / "part-1.bin").write_bytes(b"torn")  # corrupt
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_resume_on_rank,
                         args=(r, str(tmp_path / "pg-store"), str(rd.path), out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert [name for _, name, _ in results] == ["step-10", "step-10"]
    # step-20: part-0 hashed, part-1 fails on its size; step-10: its 3 files. Once in all.
    assert sum(n for _, _, n in results) == 4, results


# -- the Trainer's snapshots: failures reach status.json; the commit waits for the world --------

@pytest.fixture
def trainer_factory(rd, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments

    from workbench.train.snapshotting import snapshotting_trainer_class

    def make(max_steps: int, callbacks: list):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 100, (8, 16))]
        args = TrainingArguments(output_dir=str(rd.path / "checkpoints"), max_steps=max_steps,
                                 per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True, save_strategy="no")
        return snapshotting_trainer_class()(model=model, args=args, train_dataset=rows,
                                            callbacks=callbacks, run_dir=rd, keep=10)
    return make


def _save_every_step():
    from transformers import TrainerCallback

    class SaveEveryStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_save = True
    return SaveEveryStep()


def test_a_failed_write_shows_in_status_until_the_next_snapshot_commits(rd, trainer_factory):
    from transformers import TrainerCallback

    from workbench.runs.jobs import _snapshot_error

    # A directory where step 2's optimizer.pt must go: the writer's open() fails, for real.
    (rd.path / "checkpoints" / "checkpoint-2" / "optimizer.pt").mkdir(parents=True)
    seen: dict[int, dict] = {}

    class Look(TrainerCallback):  # before step 3 saves: step 2's outcome is in
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                trainer.writer.wait()
                seen[3] = dict(rd.status())

    trainer = trainer_factory(3, [_save_every_step(), Look()])
    trainer.train()
    trainer.writer.wait()
    err = seen[3].get("snapshot_error")
    assert err and err["step"] == 2 and err["stage"] == "write", seen[3]
    assert "optimizer.pt" in err["error"]
    assert seen[3]["snapshot"]["step"] == 1  # the last good one, as before
    assert "step 2 (write)" in _snapshot_error(err)  # what Job.summary() shows
    final = rd.status()
    assert final["snapshot"]["step"] == 3 and final.get("snapshot_error") is None
    assert verify(rd.path / "checkpoints" / "step-3") is None


def test_the_commit_waits_for_ranks_on_other_nodes(rd, trainer_factory, monkeypatch):
    from workbench.train import async_snapshot

    # The commit's wait, watched: which ranks it waits for, and that it has begun waiting.
    real_wait, waited_for, waiting = async_snapshot.wait_for_ranks, [], threading.Event()

    def watched(folder, ranks, timeout=1800.0):
        waited_for.append(list(ranks))
        waiting.set()
        return real_wait(folder, ranks, timeout)

    monkeypatch.setattr(async_snapshot, "wait_for_ranks", watched)
    trainer = trainer_factory(1, [_save_every_step()])
    # This process is global rank 0 of a world of 2, alone on its node; rank 1 (another node,
    # same shared folder) is played by the test, which writes its marker once the commit waits.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    folder = rd.path / "checkpoints" / "checkpoint-1"
    trainer.train()
    assert waiting.wait(120)
    assert waited_for == [[0, 1]]  # every rank of the world, not only this node's
    assert (folder / ".done-rank-0").is_file()
    assert not (rd.path / "checkpoints" / "step-1").exists()  # rank 1's part is not there yet
    (folder / ".done-rank-1").write_text("ok")
    trainer.writer.wait()
    assert verify(rd.path / "checkpoints" / "step-1") is None
    assert rd.status()["snapshot"]["step"] == 1


def test_a_disk_that_fills_during_a_snapshot_shows_the_error_and_keeps_training(rd,
                                                                               trainer_factory):
    import resource

    from transformers import TrainerCallback

    # A disk that fills while step 2 is written, for real: the kernel refuses any file beyond
    # 200 KB (RLIMIT_FSIZE, which fails the write with EFBIG as a full disk fails it with ENOSPC;
    # Python ignores the SIGXFSZ that comes with it). The snapshot's optimizer.pt (~680 KB) is
    # cut off part-written. Room comes back before step 3 saves.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    seen: dict[int, dict] = {}

    class Disk(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                trainer.writer.wait()  # step 1 is written in the background: let it finish
                resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
            if state.global_step == 3:
                trainer.writer.wait()
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                seen[3] = dict(rd.status())

    trainer = trainer_factory(4, [_save_every_step(), Disk()])
    try:
        trainer.train()
        trainer.writer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = seen[3].get("snapshot_error")
    assert err and err["step"] == 2 and err["stage"] == "write", seen[3]
    assert "File too large" in err["error"] or "No space" in err["error"], err
    assert seen[3]["snapshot"]["step"] == 1  # the last good one stays the one to resume from
    sizes = {p.name: p.stat().st_size for p in (rd.path / "checkpoints" / "step-1").iterdir()}
    assert max(sizes.values()) > 200_000, sizes  # the limit really cut a snapshot file short
    # The part-written snapshot is never committed; training went on and the next ones are whole.
    assert not (rd.path / "checkpoints" / "step-2" / MANIFEST).exists()
    assert trainer.state.global_step == 4
    final = rd.status()
    assert final["snapshot"]["step"] == 4 and final.get("snapshot_error") is None
    assert newest_verified(rd).name == "step-4" and verify(rd.path / "checkpoints" / "step-4") is None
