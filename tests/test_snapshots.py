"""Never lose a run: verified snapshots, automatic resume, S3, reproduce.zip (the budget stop
and its resume with a larger budget: tests/test_budget.py).

All with real training (2 gloo ranks on the built-in tiny model), a real kill -9, and a real
S3-compatible server on loopback (moto's server, reached through s3fs like any S3 endpoint).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile

import psutil
import pytest

import workbench
from tests.waiting import wait_for
from workbench.evaluate import results
from workbench.runs.procs import of_attempt
from workbench.runs.reproduce import compare_bundle, pip_freeze, scrub, write_bundle
from workbench.runs.rundir import RunDir
from workbench.runs.snapshots import MANIFEST, newest_verified, snapshots, verify
from workbench.train.callbacks import HOLD_ENV

pytestmark = pytest.mark.slow

SPEC = {"train": {"max_steps": 30, "lr": 3e-3, "log_every": 1},
        "checkpoint": {"every_steps": 10, "keep": 2}, "data": {"validation_fraction": 0.0}}
SECRETS = {"HF_TOKEN": "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", "MY_DB_PASSWORD": "hunter2-secret"}


def _losses(job) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in job.metrics() if "loss" in m}


@pytest.fixture(scope="module")
def uninterrupted():
    for k, v in SECRETS.items():  # the launching environment holds secrets; no file may
        os.environ[k] = v
    try:
        job = workbench.launch({"name": "snap-a", **SPEC})
        assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    finally:
        for k in SECRETS:
            os.environ.pop(k)
    return job


def test_snapshots_are_verified_pruned_and_latest_points_to_the_newest(uninterrupted):
    rd = uninterrupted.run_dir
    # validation_fraction 0: no validation rows, so the end-of-run scoring has nothing to score
    # and must say nothing went wrong (it once scored the empty file and recorded an error).
    assert "eval_error" not in rd.status(), rd.status().get("eval_error")
    assert [p.name for p in snapshots(rd)] == ["step-30", "step-20"]  # keep: 2
    assert (rd.path / "checkpoints" / "latest").read_text().strip() == "step-30"
    for folder in snapshots(rd):
        assert verify(folder) is None
        files = json.loads((folder / MANIFEST).read_text())["files"]
        # the whole resumable state: weights, optimizer, scheduler, RNG of every rank, position
        assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth",
                "rng_state_1.pth", "trainer_state.json"} <= set(files)
    assert not list((rd.path / "checkpoints").glob("checkpoint-*"))
    assert uninterrupted.status()["snapshot"]["path"] == "step-30"


def test_kill_9_of_a_rank_resumes_by_itself_and_continues_the_same_curve(uninterrupted, tmp_path,
                                                                         monkeypatch):
    # The run holds before step 14 (a hold file, workbench.train.callbacks.HOLD_ENV): the kill
    # lands on a live rank, after step-10 is committed, on a machine of any speed.
    hold = tmp_path / "hold"
    hold.write_text("13")
    monkeypatch.setenv(HOLD_ENV, str(hold))
    try:
        job = workbench.launch({"name": "snap-b", **SPEC})
        wait_for(lambda: max(_losses(job), default=0) >= 13 and (
            (job.status().get("snapshot") or {}).get("step") or 0) >= 10, 300,
            "step 13 logged and step-10 committed")
        assert max(_losses(job)) == 13, sorted(_losses(job))  # held: no step past the hold
        # The victim is rank 1 by its recorded identity (status.json lists each rank with its
        # pid and start time), not whichever training process happens to have the larger PID.
        victim = next(p for p in of_attempt(job.status()) if p.role == "rank" and p.rank == 1)
        assert victim.alive(), victim
        assert "-m workbench.train" in " ".join(psutil.Process(victim.pid).cmdline())  # a rank
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        hold.unlink()  # the next attempt (started by the supervisor, seconds later) runs through
    # The newest committed when it died; one whose writes were done may still commit after.
    committed = job.status()["snapshot"]["step"]
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    status = job.status()
    assert status["restarts"] == 1
    resumed = re.search(r"resuming from step-(\d+)", job.logs(tail=None, name="rank-0.log"))
    assert resumed, job.logs(tail=30, name="rank-0.log")
    resume_step = int(resumed.group(1))
    assert committed <= resume_step < 30
    a, b = _losses(uninterrupted), _losses(job)
    assert sorted(b) == list(range(1, 31))
    for step in range(resume_step + 1, 31):  # after the resume, step by step, the uninterrupted curve
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step


def test_partial_and_corrupt_snapshots_are_skipped(uninterrupted, tmp_path):
    rd = RunDir(tmp_path / uninterrupted.run_dir.path.name)
    shutil.copytree(uninterrupted.run_dir.path, rd.path)
    # What a kill during a snapshot write leaves: a newer folder with no manifest...
    shutil.copytree(rd.path / "checkpoints" / "step-30", rd.path / "checkpoints" / "step-40")
    (rd.path / "checkpoints" / "step-40" / MANIFEST).unlink()
    # ...and a flipped byte in the newest complete one.
    blob = rd.path / "checkpoints" / "step-30" / "optimizer.pt"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.warns(UserWarning) as caught:
        assert newest_verified(rd).name == "step-20"
    messages = " ".join(str(w.message) for w in caught)
    assert "step-40: no manifest" in messages and "step-30: optimizer.pt does not match" in messages


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}).mkdir("runs")
    yield env
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def test_upload_to_s3_then_resume_into_an_empty_run_directory(s3_endpoint):
    import s3fs

    # Evaluation off: nothing here reads scores, and each end-of-run scoring (twice: both
    # attempts) cost the suite time. It also makes this the run that checks "eval off" (it has
    # a validation split, so the default would have scored it): nothing scored, ever.
    job = workbench.launch({"name": "s3", "train": {"max_steps": 20, "lr": 3e-3},
                            "checkpoint": {"every_steps": 10, "storage": "s3://runs/wb"},
                            "eval": {"before": False, "after": False}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    assert job.status()["upload"]["state"] == "uploaded"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"]})
    prefix = f"runs/wb/{job.id}"
    assert fs.cat(f"{prefix}/latest").decode().strip() == "step-20"
    assert fs.exists(f"{prefix}/step-20/{MANIFEST}")
    shutil.rmtree(job.run_dir.path / "checkpoints")  # the node's disk is gone
    job.resume(**{"train.max_steps": 30})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    assert "fetched step-20" in job.logs(tail=None, name="supervisor.log")
    assert "resuming from step-20" in job.logs(tail=None, name="rank-0.log")
    assert not (job.run_dir.path / results.FILE).exists()  # eval off: nothing scored
    assert job.status()["step"] == 30


def test_the_bundled_package_list_is_what_pip_freeze_prints():
    # The bundle reads package metadata in-process (pip's own start-up was ~1.5 s at the end of
    # every run); pip itself is the reference. Only pip's wording of an editable install's
    # comment line may differ (it asks git about the checkout).
    real = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True,
                          text=True, check=True, timeout=300).stdout
    assert real.strip()

    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert lines(pip_freeze()) == lines(real)


def test_reproduce_bundle_recreates_the_spec_and_holds_no_secret(uninterrupted, tmp_path):
    bundle = uninterrupted.run_dir.path / "reproduce.zip"
    assert uninterrupted.status()["bundle"] == "reproduce.zip"
    with zipfile.ZipFile(bundle) as zf:
        names = set(zf.namelist())
        blob = b"".join(zf.read(n) for n in names)
    assert {"spec.yaml", "plan.json", "status.json", "version.json", "requirements.txt",
            "commands.json", "checksums.json", "logs/rank-0.log", "metrics.jsonl"} <= names
    assert any(n.startswith("tb/") for n in names)
    checksums = json.loads(zipfile.ZipFile(bundle).read("checksums.json"))
    assert "step-30" in checksums["snapshots"] and checksums["artefacts"]
    assert json.loads(zipfile.ZipFile(bundle).read("status.json"))["state"] == "succeeded"
    # Secrets of the launching environment are in no run file and no bundle.
    for value in SECRETS.values():
        assert value.encode() not in blob
        for path in uninterrupted.run_dir.path.rglob("*"):
            if path.is_file() and path.suffix in (".log", ".json", ".jsonl", ".yaml"):
                assert value not in path.read_text(errors="replace"), path
    # A secret a user printed into a log is scrubbed when bundled.
    rd = RunDir(tmp_path / "copy")
    shutil.copytree(uninterrupted.run_dir.path, rd.path)
    with (rd.logs_dir / "rank-0.log").open("a") as fh:
        fh.write(f"debug: token={SECRETS['MY_DB_PASSWORD']} key {SECRETS['HF_TOKEN']}\n")
    with zipfile.ZipFile(write_bundle(rd)) as zf:
        log = zf.read("logs/rank-0.log").decode()
    assert SECRETS["HF_TOKEN"] not in log and SECRETS["MY_DB_PASSWORD"] not in log
    assert "token=***" in log
    report = compare_bundle(bundle)
    assert report.spec == uninterrupted.spec and report.run_id == uninterrupted.id
    # Same interpreter, same packages (the git commit may move on while tests run in a checkout).
    assert not (report.packages_changed or report.packages_missing or report.packages_added)
    assert report.recorded["python"] == report.current["python"]
    assert len(report.recorded.get("git_commit", "")) == 40, report.recorded
    with pytest.raises(workbench.WorkbenchError, match="not found"):
        compare_bundle(tmp_path / "nope.zip")


# Resumes the shared run, and asserts that what the other tests read of it (its losses, its
# snapshots, its weights) is as the run first ended: they pass before or after it.
def test_a_resume_at_the_final_step_trains_nothing_and_ends_as_the_run_did(uninterrupted):
    from safetensors.torch import load_file

    job = uninterrupted
    before = job.status()
    adapter = job.artefact() / "adapter_model.safetensors"
    weights, saved_at = load_file(adapter), adapter.stat().st_mtime_ns
    assert newest_verified(job.run_dir).name == "step-30"  # the snapshot at the final step
    job.resume()
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    status = job.status()
    assert status["attempt"] == before["attempt"] + 1
    assert "resuming from step-30" in job.logs(tail=None, name="rank-0.log")
    # Every line metrics.jsonl holds, either attempt's: no step past the last (was: step 31).
    lines = [json.loads(x) for x in job.run_dir.metrics_file.read_text().splitlines()]
    assert max(m["step"] for m in lines if "step" in m) == 30
    assert sorted(_losses(job)) == list(range(1, 31))
    assert status["step"] == status["total_steps"] == 30
    assert status["summary"] == before["summary"]  # the training attempt's, not a 0-step one
    # The end saved the outputs again, and they hold the snapshot's (the trained) weights.
    assert adapter.stat().st_mtime_ns > saved_at
    again = load_file(adapter)
    assert again.keys() == weights.keys()
    assert all(again[k].equal(weights[k]) for k in weights)
    assert [p.name for p in snapshots(job.run_dir)] == ["step-30", "step-20"]


def test_scrub_masks_token_shapes_and_named_secrets():
    text = "hf_abcdefghijklmnopqrstu sk-abcdefghijklmnopqrstuv AKIAABCDEFGHIJKLMNOP password: x1"
    out = scrub(text, secrets=["x1"])
    assert "hf_abc" not in out and "sk-abc" not in out and "AKIA" not in out
    assert "password: ***" in out
