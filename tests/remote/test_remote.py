"""Remote targets against real components: an sshd on loopback and a one-machine Slurm cluster.

The runs are tiny (10-15 steps of the built-in model) but real: two supervisors joined by a c10d
rendezvous over SSH, sbatch + srun + torchrun under slurmd, DeepSpeed ZeRO-2/3 on CPU, scancel
and scontrol requeue. The time-limit job is submitted first and checked last, so its minute of
waiting overlaps the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import workbench
from tests.remote.cluster import processes_with, squeue_job_names
from workbench.spec import RunSpec
from workbench.targets.backends.remote import SSHTransport
from workbench.targets.backends.slurm import sbatch_script
from workbench.targets.backends.ssh import SSHBackend
from workbench.targets.check import check_target
from workbench.targets.named import TargetError, get_target, target_names

pytestmark = pytest.mark.slow
TINY = {"train": {"max_steps": 10, "lr": 3e-3}}


def _squeue() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True)
    return out.stdout.split("\n")[:-1]


def _nothing_left(run_id: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and (processes_with(run_id) or any(_squeue_names(run_id))):
        time.sleep(0.5)
    assert not processes_with(run_id), [p.cmdline() for p in processes_with(run_id)]
    assert not _squeue_names(run_id)


def _squeue_names(run_id: str) -> list[str]:
    return [n for n in squeue_job_names() if run_id[:50] in n]


def _wait_running(job: workbench.Job, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if job.state == "running" and any(job.run_dir.logs_dir.glob("rank-*.log")):
            return
        assert not job.done, job.status()
        time.sleep(0.5)
    raise AssertionError(f"{job.id} did not start: {job.status()}")


@pytest.fixture(scope="module")
def timeout_job(targets):
    return workbench.launch({"name": "limit", "target": "slurm:short", **TINY})


@pytest.fixture(scope="module")
def lingering(targets):
    # Jobs that go on after their run recorded how it ended, until the time limit
    # (slurm:linger, 2 minutes) or a scancel (slurm:lingerlong) stops them: one succeeds, one
    # stops at its budget.
    done = workbench.launch({"name": "lingerok", "target": "slurm:linger", **TINY})
    # 3,600 per core-hour on one process: 1 per second, so a limit of 40 stops within a minute.
    stop = workbench.launch({"name": "lingerbudget", "target": "slurm:lingerlong",
                             "train": {"max_steps": 100000},
                             "budget": {"price_per_cpu_core_hour": 3600.0, "limit": 40.0}})
    return done, stop


def test_time_limit_job_is_submitted_first(timeout_job, lingering):
    # Slurm itself, asked by its own client, holds each job under the id the record keeps.
    queue = dict(line.split() for line in _squeue())
    for job in (timeout_job, *lingering):
        slurm_id = job.record.backend_job_id.removeprefix("slurm:")
        assert slurm_id in queue, (job.record.backend_job_id, queue)
        assert queue[slurm_id] in ("PENDING", "CONFIGURING", "RUNNING"), queue[slurm_id]
        assert job.state in ("queued", "running")


# -- configuration and checks ------------------------------------------------------------------

def test_targets_load_and_are_offered(targets):
    names = target_names()
    assert names[0] == "local" and {"ssh:pair", "slurm:local", "slurm:login"} <= set(names)
    pair = get_target("ssh:pair")
    assert [h.host for h in pair.hosts] == ["wb-node0", "wb-node1"]
    with pytest.raises(TargetError, match="not configured.*targets.yaml"):
        get_target("ssh:nope")


def test_target_defaults_fill_only_what_the_spec_left_unset(targets):
    from workbench.targets.named import apply_defaults
    from workbench.widgets import RunForm

    pair = get_target("ssh:pair")
    assert apply_defaults(RunSpec(), pair).resources.nodes == 2
    explicit = RunSpec.parse({"resources": {"nodes": 1}})
    assert apply_defaults(explicit, pair).resources.nodes == 1
    form = RunForm(RunSpec())
    assert {"local", "ssh:pair", "slurm:local"} <= set(form.target.options)
    form.target.value = "ssh:pair"
    assert form.procs.value == 1 and form.spec.resources.nodes == 2
    assert form.spec.target == "ssh:pair"


def test_check_reports_what_works_and_what_is_missing(targets):
    ok = check_target("ssh:one")
    assert ok.ok, str(ok)
    text = str(ok)
    for item in ("reachable (wb-node0)", "torch (wb-node0)", "GPUs (wb-node0)",
                 "free disk (wb-node0)", "calibration"):
        assert item in text
    # A ready target is measured there (the probe over SSH), and plans of it say so.
    from workbench.plan import plan

    one = plan({"target": "ssh:one", "train": {"max_steps": 10}}).clock
    assert one["calibration"]["source"] == "target probe", one["basis"]
    assert "calibrated by a probe on ssh:one" in one["basis"]
    down = check_target("ssh:down")
    assert not down.ok and "reachable (127.0.0.1)" in down.missing[0].name
    assert "Connection refused" in down.missing[0].detail
    nopart = check_target("slurm:nopart")
    missing = {c.name: c for c in nopart.missing}
    assert "partition" in missing and "debug" in missing["partition"].fix
    broken = check_target("ssh:broken")
    assert any("/nonexistent/env/bin/python" in c.detail for c in broken.missing)
    # The checks saw the device the probe measured on that host; so a check reuses the probe
    # however old it is (the CLI's, below), and measures again once the stored device differs.
    from workbench.plan.calibrate import calibration_file

    path = calibration_file("ssh:one")
    measured = json.loads(path.read_text())
    assert {k: measured["device"][k] for k in ("kind", "name", "cores")} == ok.devices["wb-node0"]
    old = time.time() - 7200
    os.utime(path, (old, old))
    # The CLI's exit status says whether the target is ready.
    from workbench.cli import main

    assert main(["targets", "check", "ssh:one"]) == 0
    assert path.stat().st_mtime == old and json.loads(path.read_text()) == measured
    from workbench.plan.probe import probe_target

    path.write_text(json.dumps({**measured, "device": {**measured["device"], "name": "Other"}}))
    probe_target("ssh:one", device=ok.devices["wb-node0"])  # what the check does with what it saw
    again = json.loads(path.read_text())
    assert again["device"] == measured["device"] and again["source"] == "target probe"
    assert main(["targets", "check", "ssh:broken"]) == 1


def test_a_remote_target_is_calibrated_by_a_probe_run_there(targets, cluster):
    from workbench.plan import plan
    from workbench.plan.calibrate import CalibrationError, calibration_file
    from workbench.plan.probe import probe_target

    spec = {"train": {"max_steps": 10}, "resources": {"processes_per_node": 1}}
    before = plan({**spec, "target": "slurm:local"}).clock
    assert before["calibration"]["source"] == "default" and "not calibrated" in before["basis"]
    report = check_target("slurm:local")  # ready, so it probes: a one-task srun job
    line = next(c for c in report.checks if c.name == "calibration")
    assert line.ok, str(report)
    stored = json.loads(calibration_file("slurm:local").read_text())
    assert stored["source"] == "target probe" and stored["date"] == time.strftime("%Y-%m-%d")
    # It ran as a job of this cluster: Slurm's own completion log has it, under its name.
    job = stored["where"].split()[2]
    assert stored["where"].startswith("Slurm job ")
    done = (cluster.root / "jobcomp.txt").read_text()
    assert f"JobId={job} " in done and "Name=wb-calibrate" in done
    after = plan({**spec, "target": "slurm:local"}).clock
    assert after["calibration"] == {"source": "target probe", "date": stored["date"],
                                    "where": stored["where"]}
    assert f"calibrated by a probe on slurm:local (Slurm job {job}" in after["basis"]
    assert after["step_s"] != before["step_s"]
    # Cached per target: another target is still planned from the table.
    assert plan({**spec, "target": "slurm:login"}).clock["calibration"]["source"] == "default"
    # A target where the probe cannot run: a clear error, nothing stored.
    with pytest.raises(CalibrationError, match="(?s)nope.*targets check slurm:nopart"):
        probe_target("slurm:nopart")
    assert not calibration_file("slurm:nopart").exists()


def test_sbatch_script_asks_for_what_the_spec_needs(targets):
    spec = RunSpec.parse({"resources": {"nodes": 2, "gpus_per_node": 4}})
    target = get_target("slurm:login").model_copy(update={"partition": "gpu", "account": "p1",
                                                          "qos": "high", "mem": "64G"})
    script = sbatch_script(spec, target, "/scratch/runs/r1", "wb-r1")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:4",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --mem=64G", "#SBATCH --time=00:10:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=p1", "#SBATCH --qos=high",
                 "#SBATCH --requeue", "#SBATCH --output=/scratch/runs/r1/logs/slurm-%j.out",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "--node-rank \"$SLURM_NODEID\""):
        assert line in script, line
    assert "--gres" not in sbatch_script(RunSpec(), target, "/r", "wb")


# -- runs ---------------------------------------------------------------------------------------

def test_two_nodes_that_share_no_folder_need_storage(targets):
    with pytest.raises(TargetError, match=r"(?s)wb-node1 do\(es\) not share a folder with "
                                          r"wb-node0.*-> set checkpoint\.storage"):
        workbench.launch({"name": "ssh2bare", "target": "ssh:pair", **TINY,
                          "parallel": {"strategy": "ddp"}})
    refused = workbench.get_job("ssh2bare")
    assert refused.state == "failed" and "checkpoint.storage" in refused.status()["error"]
    _nothing_left(refused.id)


def _node1_rank(run_id: str, timeout: float = 240) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [p for p in processes_with(f"node1/{run_id}")
                 if "-m workbench.train" in " ".join(p.cmdline())
                 and "torch.distributed.run" not in " ".join(p.cmdline())]  # not torchrun
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError("no rank of node 1 is running")


def _placement(job: workbench.Job) -> dict:
    return json.loads((job.run_dir.path / "remote.json").read_text())


def _final(job: workbench.Job) -> bool:
    return bool(_placement(job).get("final"))


def _last_resume(log: str) -> str:
    return [ln for ln in log.splitlines() if ln.startswith("resuming from")][-1]


def test_two_node_ssh_run_without_shared_folder_resumes_every_node_from_storage(targets, cluster,
                                                                               monkeypatch):
    """Trains, snapshots to storage, loses node 1's rank (kill -9), comes back whole through
    a small sync chunk, and resumes both nodes from the same stored snapshot. Being the first
    launch on ssh:pair, it measures the target there for its own plan."""
    from workbench.plan.calibrate import calibration_file
    from workbench.plan.probe import LAUNCH_PROBE_ENV

    monkeypatch.setenv(LAUNCH_PROBE_ENV, "1")
    assert not calibration_file("ssh:pair").exists()
    # Two nodes of one process each come from the target's defaults in targets.yaml; each host
    # has its own workdir, so snapshots reach node 1 only through checkpoint.storage. Plain
    # DDP: DeepSpeed's CPU communication can hang when two "nodes" share one host (seen in CI).
    storage = cluster.root / "storage"
    job = workbench.launch({"name": "ssh2", "target": "ssh:pair",
                            "train": {"max_steps": 100000, "lr": 3e-3},
                            "checkpoint": {"every_steps": 3, "storage": str(storage)},
                            "parallel": {"strategy": "ddp"}})
    assert job.spec.resources.nodes == 2 and job.spec.resources.procs_per_node == 1
    calibration = json.loads(calibration_file("ssh:pair").read_text())
    assert calibration["source"] == "target probe", calibration
    clock = json.loads(job.run_dir.plan_file.read_text())["clock"]
    assert clock["calibration"] == {"source": "target probe", "date": calibration["date"],
                                    "where": calibration["where"], "measured_now": True}, clock
    assert f"measured on {calibration['where']} now" in clock["basis"], clock["basis"]
    try:
        stored = storage / job.id / "latest"
        deadline = time.time() + 300
        while time.time() < deadline and not stored.exists():
            assert not job.done, job.logs(tail=30)
            time.sleep(0.5)
        assert stored.exists(), job.logs(tail=30)
        for p in _node1_rank(job.id):
            p.kill()  # kill -9 of node 1's rank: the run cannot go on without it
        # Watched through a backend that brings at most 256 bytes per file per round trip: the
        # mirror must still be complete when it is frozen.
        small = SSHBackend("ssh:pair", chunk=256)
        deadline = time.time() + 300
        while time.time() < deadline and not _final(job):
            small.status(job.run_dir.path, None)
            time.sleep(0.5)
        assert job.state == "failed", job.logs(tail=30)
        stopped_at = max(m["step"] for m in job.metrics() if "loss" in m)
        _nothing_left(job.id)
        remote = [Path(n["dir"]) for n in _placement(job)["nodes"]]
        mirrored = {"metrics.jsonl": remote[0] / "metrics.jsonl",
                    "logs/rank-0.log": remote[0] / "logs/rank-0.log",
                    "logs/node-1-rank-1.log": remote[1] / "logs/rank-1.log"}
        assert all(path.stat().st_size > 2 * 256 for path in mirrored.values())
        original = {name: path.read_bytes() for name, path in mirrored.items()}
        for name in mirrored:
            assert (job.run_dir.path / name).read_bytes() == original[name], name
            # A mirror that lags behind (as a truncated one did) must not be pushed back over
            # the originals by the resume.
            with (job.run_dir.path / name).open("r+b") as fh:
                fh.truncate(len(original[name]) // 2)
        job.resume(**{"train.max_steps": stopped_at + 4})
        assert job.wait(timeout=400, progress=False) == "succeeded", job.logs(tail=30)
    finally:
        job.cancel()  # a run that failed an assertion must not keep the cores busy
    for name, path in mirrored.items():
        assert path.read_bytes().startswith(original[name]), name
        assert (job.run_dir.path / name).read_bytes() == path.read_bytes(), name
    status = job.status()
    assert status["world_size"] == 2 and status["step"] == stopped_at + 4
    placement = _placement(job)
    assert [n["rank"] for n in placement["nodes"]] == [0, 1]
    assert placement["nodes"][0]["dir"] != placement["nodes"][1]["dir"]
    logs = job.backend.logs(job.run_dir.path)
    # Global rank 0 ran on node 0 (its log is node 0's own), and both nodes resumed from the
    # same snapshot: node 1 fetched it from storage instead of starting again at step 0.
    assert "workbench.train rank 0/2" in logs["rank-0.log"]
    assert "workbench.train rank 1/2" in logs["node-1-rank-1.log"]
    resumed = _last_resume(logs["rank-0.log"])
    assert resumed == _last_resume(logs["node-1-rank-1.log"])
    raw = job.run_dir.metrics()
    marker = [m for m in raw if m.get("event") == "resume"][-1]
    assert resumed == f"resuming from step-{marker['step']}" and marker["step"] > 0
    steps = [m["step"] for m in job.metrics() if "loss" in m]
    assert steps == list(range(1, stopped_at + 5))
    assert (job.artefact() / "adapter_config.json").is_file()  # copied back from node 0
    again = workbench.get_job(job.id)  # a fresh handle (e.g. after a kernel restart)
    assert again.state == "succeeded" and again.metrics() == job.metrics()
    assert job.backend.read(job.run_dir.path, "metrics.jsonl", 0).count(b"\n") == len(raw)
    _nothing_left(job.id)
    _evaluate_on_node0(job, remote[0])


def _evaluate_on_node0(job: workbench.Job, node0: Path) -> None:
    """job.evaluate on an SSH run scores on the host that holds the weights: the line lands in
    node 0's eval.jsonl and the mirror receives the same bytes; a bad task file is the typed
    error raised there, and leaves both files as they were."""
    from workbench.errors import EvalTaskError

    local = job.run_dir.path / "eval.jsonl"
    before = local.read_bytes()
    assert before == (node0 / "eval.jsonl").read_bytes()  # the run's own "after" line(s)
    report = job.evaluate(["heldout"], max_samples=4)
    (line,) = report.lines
    assert (line["phase"], line["task"], line["n"], line["step"]) == (
        "manual", "heldout", 4, job.status()["step"])
    remote = (node0 / "eval.jsonl").read_bytes()
    assert remote.startswith(before) and json.loads(remote[len(before):]) == line
    assert local.read_bytes() == remote
    assert (job.run_dir.path / line["examples"]).read_bytes() == (
        node0 / line["examples"]).read_bytes()
    assert len(report.examples["heldout"]) == 4
    assert job.status()["eval"]["heldout.rouge_l"] == line["metrics"]["rouge_l"]
    with pytest.raises(EvalTaskError, match="wb-node0.*does not exist"):
        job.evaluate([{"kind": "heldout", "file": str(node0 / "no-such.jsonl")}])
    assert local.read_bytes() == remote == (node0 / "eval.jsonl").read_bytes()


# -- cancel -------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["ssh:apart", "slurm:apart"])
def test_cancel_stops_every_process(targets, cluster_model, target):
    # The model is a folder only the target has (cluster_model): checked and planned there.
    model_id, folder = cluster_model
    job = workbench.launch({"name": "cancelme", "target": target, "model": {"id": model_id},
                            "train": {"max_steps": 100000}})
    _planned_on_the_target(job, folder)
    _wait_running(job)
    if target.startswith("ssh:"):
        # The connection drops for the cancel: nothing is known, so nothing is recorded.
        t = get_target(target)
        cut = t.model_copy(update={"hosts": [h.model_copy(update={"port": 1}) for h in t.hosts],
                                   "connect_timeout": 3})
        with pytest.raises(TargetError, match="could not confirm .* stopped"):
            SSHBackend(target, cut).cancel(job.run_dir.path, job.record.backend_job_id, timeout=2)
        assert job.run_dir.status()["state"] == "running"
        assert "may still be training" in job.run_dir.status()["warning"]
        assert not _final(job)
        step = job.status().get("step") or 0  # reachable again: still watched, still training
        assert job.state == "running" and not job.status().get("warning")
        deadline = time.time() + 120
        while time.time() < deadline and (job.status().get("step") or 0) <= step:
            time.sleep(0.5)
        assert (job.status().get("step") or 0) > step
    assert job.cancel() == "cancelled"
    assert workbench.get_job(job.id).state == "cancelled"
    _nothing_left(job.id)
    if target.startswith("slurm:"):
        _evaluate_on_the_cluster(job)


def _evaluate_on_the_cluster(job: workbench.Job) -> None:
    """job.evaluate on a Slurm run whose directory is on the cluster's workdir: scored in a
    Slurm job of its own (srun from the login node over SSH); the line lands in the cluster's
    eval.jsonl and the mirror receives the same bytes. Bad inputs are typed errors that leave
    both files as they were."""
    from workbench.errors import EvalError, SpecError

    cluster_dir = Path(_placement(job)["dir"])
    # Cancelled before any weights were saved: refused where the run directory is.
    with pytest.raises(EvalError, match=r"wb-node0.*has no adapter/ or model/"):
        job.evaluate(["heldout"])
    assert not (cluster_dir / "eval.jsonl").exists()
    # Resume submits the same run directory again (sbatch over SSH); the adapter of the
    # finished run comes back from the cluster's workdir.
    job.resume(**{"train.max_steps": 5})
    assert job.wait(timeout=300, progress=False) == "succeeded", job.logs(tail=30)
    assert (job.artefact() / "adapter_config.json").is_file()
    assert "data: train tokenised" in job.logs(tail=None, name="rank-0.log")  # on the target
    _nothing_left(job.id)
    local = job.run_dir.path / "eval.jsonl"
    before = local.read_bytes()
    assert before == (cluster_dir / "eval.jsonl").read_bytes()  # the run's own "after" line
    report = job.evaluate(["heldout"], max_samples=4)
    (line,) = report.lines
    assert (line["phase"], line["task"], line["n"], line["step"]) == ("manual", "heldout", 4, 5)
    remote = (cluster_dir / "eval.jsonl").read_bytes()
    assert remote.startswith(before) and json.loads(remote[len(before):]) == line
    assert local.read_bytes() == remote
    assert (job.run_dir.path / line["examples"]).read_bytes() == (
        cluster_dir / line["examples"]).read_bytes()
    assert job.status()["eval"]["heldout.rouge_l"] == line["metrics"]["rouge_l"]
    # Both evaluations ran as jobs of the cluster's (slurmctld keeps ended jobs for MinJobAge,
    # 600 s here), not on the login node: the refused one failed, the scored one completed.
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%j %T"], capture_output=True,
                         text=True).stdout.split("\n")
    states = [ln.split()[1] for ln in out if ln.startswith(f"wb-eval-{job.run_dir.path.name}"[:64])]
    assert sorted(states) == ["COMPLETED", "FAILED"], out
    with pytest.raises(SpecError, match="eval.tasks"):
        job.evaluate(["no-such-task"])
    assert local.read_bytes() == remote == (cluster_dir / "eval.jsonl").read_bytes()


def _planned_on_the_target(job: workbench.Job, folder: Path) -> None:
    """The plan counted the folder on the target (its weights, read here with safetensors: one
    layer fewer than the built-in), and launch left tokenising to the ranks."""
    from workbench.assets import builtin_model_path

    plan = json.loads((job.run_dir.path / "plan.json").read_text())
    assert "host wb-node0" in plan["model_source"], plan["model_source"]
    assert plan["params"] == _weights(folder) != _weights(builtin_model_path())
    assert "the ranks tokenise" in job.run_dir.status()["prepare"]["skipped"]
    assert not (job.run_dir.data_dir / "tokenized").exists()


def _weights(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118 (not iterable)


# -- errors -------------------------------------------------------------------------------------

def test_unreachable_host_is_a_clear_error(targets):
    with pytest.raises(TargetError, match=r"cannot reach 127\.0\.0\.1.*\n-> .*unreachable"):
        workbench.launch({"name": "down", "target": "ssh:down", **TINY})
    failed = workbench.get_job("down")
    assert failed.state == "failed" and "cannot reach" in failed.status()["error"]
    _nothing_left(failed.id)


def test_a_model_folder_the_target_lacks_is_refused_before_anything_is_made(
        targets, target_home):
    """A folder that is neither here nor on the target names both places; one without its
    config.json or tokenizer there says what to save; a relative path is refused. No run is
    registered for any of them."""
    from workbench.errors import ModelNotFoundError
    from workbench.runs.registry import Registry

    before = {r.id for r in Registry().list_runs()}
    assert not Path(os.path.expanduser("~/models/nowhere")).exists()
    with pytest.raises(ModelNotFoundError) as refused:
        workbench.launch({"name": "nomodel", "target": "ssh:apart", **TINY,
                          "model": {"id": "~/models/nowhere"}})
    message = str(refused.value)
    assert "neither on this machine" in message and "copy the model folder" in message
    assert os.path.expanduser("~/models/nowhere") in message  # here
    assert f"host wb-node0 ({target_home}/models/nowhere)" in message  # there
    half = target_home / "models" / "half"
    half.mkdir(parents=True, exist_ok=True)
    with pytest.raises(ModelNotFoundError, match=f"{half} on host wb-node0 has no readable "
                                                 "config.json.*save_pretrained"):
        workbench.launch({"name": "nomodel", "target": "ssh:apart", **TINY,
                          "model": {"id": "~/models/half"}})
    (half / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelNotFoundError, match="has no tokenizer.*tokenizer.save_pretrained"):
        workbench.launch({"name": "nomodel", "target": "slurm:apart", **TINY,
                          "model": {"id": "~/models/half"}})
    with pytest.raises(ModelNotFoundError, match="relative path.*absolute path on the target"):
        workbench.launch({"name": "nomodel", "target": "ssh:apart", **TINY,
                          "model": {"id": "./models/half"}})
    assert {r.id for r in Registry().list_runs()} == before


def test_unknown_host_key_is_refused_by_default(targets):
    with pytest.raises(TargetError, match=r"host key of 127\.0\.0\.1 is not in \S*known_hosts"):
        workbench.launch({"name": "hostkey", "target": "ssh:unknown-key", **TINY})


def test_the_unknown_host_key_fix_works_as_written(targets, cluster):
    # The error names the one command that adds the key where this target's ssh looks for it
    # (ssh-keyscan takes no USER@ and reads no ssh config: the port is the target's own).
    target = get_target("ssh:unknown-key")
    known = cluster.root / "empty_known_hosts"
    with pytest.raises(TargetError) as refused:
        SSHTransport(target.hosts[0], target).run("true")
    commands = [line.strip() for line in str(refused.value).splitlines()
                if line.strip().startswith("ssh-keyscan")]
    assert commands == [f"ssh-keyscan -p {cluster.ssh_port} 127.0.0.1 | ssh-keygen -lf -",
                        f"ssh-keyscan -p {cluster.ssh_port} 127.0.0.1 >> {known}"]
    try:
        shown = subprocess.run(["bash", "-c", commands[0]], check=True, capture_output=True,
                               text=True, timeout=30).stdout
        fingerprint = subprocess.run(["ssh-keygen", "-lf", f"{cluster.ssh_config.parent}/"
                                      "host_ed25519.pub"], check=True, capture_output=True,
                                     text=True).stdout.split()[1]
        assert fingerprint in shown, shown  # the sshd's own host key (tests/remote/cluster.py)
        subprocess.run(["bash", "-c", commands[1]], check=True, capture_output=True, timeout=30)
        assert SSHTransport(target.hosts[0], target).run("echo in").stdout == b"in\n"
    finally:
        known.write_text("")  # unknown again for the other tests


def test_the_changed_host_key_fix_works_as_written(targets, cluster, tmp_path):
    # known_hosts holds another key for the host: ssh refuses; the error names the two commands
    # that replace it, and once they ran as written ssh logs in.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")],
                   check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{cluster.ssh_port} "
                     f"{' '.join((tmp_path / 'other.pub').read_text().split()[:2])}\n")
    target = get_target("ssh:unknown-key").model_copy(update={"known_hosts": str(known)})
    with pytest.raises(TargetError, match="(?s)REMOTE HOST IDENTIFICATION HAS CHANGED.*not the "
                                          "one .* holds") as refused:
        SSHTransport(target.hosts[0], target).run("true")
    lines = [line.strip() for line in str(refused.value).splitlines()]
    commands = [line for line in lines if line.startswith(("ssh-keygen -R", "ssh-keyscan"))]
    assert commands == [f"ssh-keygen -R '[127.0.0.1]:{cluster.ssh_port}' -f {known}",
                        f"ssh-keyscan -p {cluster.ssh_port} 127.0.0.1 >> {known}"]
    for command in commands:
        subprocess.run(["bash", "-c", command], check=True, capture_output=True, timeout=30)
    assert SSHTransport(target.hosts[0], target).run("echo in").stdout == b"in\n"


def test_ssh_options_written_as_numbers_and_yes_no_log_in(targets, cluster, tmp_path,
                                                           monkeypatch):
    # YAML reads the port as a number and yes as true; ssh gets Port=N and IdentitiesOnly=yes.
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    (tmp_path / "targets.yaml").write_text(
        "ssh:\n  numbers:\n    hosts: [127.0.0.1]\n"
        f"    identity_file: {cluster.identity}\n    known_hosts: {cluster.known_hosts}\n"
        f"    ssh_options: {{Port: {cluster.ssh_port}, IdentitiesOnly: yes, "
        "ServerAliveCountMax: 3}\n")
    target = get_target("ssh:numbers")
    assert SSHTransport(target.hosts[0], target).run("echo in").stdout == b"in\n"


def test_broken_remote_env_surfaces_the_remote_error(targets, monkeypatch):
    from workbench.plan.calibrate import CalibrationWarning, calibration_file
    from workbench.plan.probe import LAUNCH_PROBE_ENV

    with pytest.raises(TargetError, match="(?s)broken on host wb-node0.*/nonexistent/env/bin/"
                                          "python: No such file or directory"):
        workbench.launch({"name": "brokenssh", "target": "ssh:broken", **TINY})
    # The first launch on slurm:broken probes it too; the probe's failure does not stop the
    # launch (the job fails by itself, below): the plan says why it used the table.
    monkeypatch.setenv(LAUNCH_PROBE_ENV, "1")
    with pytest.warns(CalibrationWarning, match="probe of slurm:broken failed"):
        job = workbench.launch({"name": "brokenslurm", "target": "slurm:broken", **TINY})
    assert not calibration_file("slurm:broken").exists()
    clock = json.loads(job.run_dir.plan_file.read_text())["clock"]
    assert clock["calibration"]["source"] == "default", clock
    assert "/nonexistent/env/bin/python" in clock["calibration"]["probe_error"], clock
    assert "calibration probe of slurm:broken at this launch failed" in clock["basis"]
    assert "not calibrated" in clock["basis"]
    assert job.wait(timeout=120, progress=False) == "failed"
    error = job.status()["error"]
    assert "ended FAILED" in error and "/nonexistent/env/bin/python" in error, error
    _nothing_left(job.id)


def test_more_gpus_than_the_ssh_host_has_is_refused_before_anything_starts(targets):
    # The host has no GPU torch can use (none here): asking for 2 must be refused at submit
    # with the numbers, not left to fail on the host after the run is reported started.
    with pytest.raises(TargetError, match=r"resources\.gpus_per_node is 2 but host wb-node0 "
                                          r"has 0 GPU\(s\).*lower resources\.gpus_per_node"):
        workbench.launch({"name": "toomanygpus", "target": "ssh:one", **TINY,
                          "resources": {"gpus_per_node": 2, "gpu_type": "T4"}})
    job = workbench.get_job("toomanygpus")
    assert job.state == "failed" and "has 0 GPU(s)" in job.status()["error"]
    _nothing_left(job.id)


def test_unknown_partition_and_rejected_sbatch_leave_nothing(targets):
    with pytest.raises(TargetError, match="(?s)invalid partition.*one of: debug"):
        workbench.launch({"name": "nopart", "target": "slurm:nopart", **TINY})
    # --mem=64G where the node has 20000 MB: sbatch itself rejects the job.
    with pytest.raises(TargetError, match="(?s)sbatch refused.*not available.*lower resources"):
        workbench.launch({"name": "toobig", "target": "slurm:bigmem", **TINY})
    for name in ("nopart", "toobig"):
        job = workbench.get_job(name)
        assert job.state == "failed" and "sbatch refused" in job.status()["error"]
        _nothing_left(job.id)


def test_a_request_no_node_of_the_partition_has_is_refused_before_sbatch(targets):
    # cluster.py's one node: CPUs=8 RealMemory=20000 Gres=gpu:2, partition debug. Four GPUs
    # (four processes of 4 CPUs) or two nodes would be accepted by sbatch and left pending for
    # ever (PartitionConfig, PartitionNodeLimit): the launch refuses them before anything.
    from workbench.errors import ResourceError
    from workbench.runs.home import runs_dir
    from workbench.runs.registry import Registry

    runs, folders = {r.id for r in Registry().list_runs()}, set(runs_dir().iterdir())
    with pytest.raises(ResourceError) as refused:
        workbench.launch({"name": "fourgpus", "target": "slurm:local", **TINY,
                          "resources": {"gpus_per_node": 4, "gpu_type": "T4"}})
    message = str(refused.value)
    assert "asks for 1 node(s) with 4 GPU(s) and 16 CPUs each" in message, message
    assert "partition 'debug' has 1 node(s) with 8 CPUs, 20000 MB, gres gpu:2" in message
    assert "set resources.gpus_per_node to at most 2" in message
    with pytest.raises(ResourceError, match=r"asks for 2 node\(s\).* set resources\.nodes to at "
                                            r"most 1;"):
        workbench.launch({"name": "twonodes", "target": "slurm:local", **TINY,
                          "resources": {"nodes": 2}})
    # slurmctld keeps every job it was given, ended or not, for MinJobAge (600 s): none came.
    jobs = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True,
                          check=True).stdout
    assert "JobName=wb-fourgpus" not in jobs and "JobName=wb-twonodes" not in jobs
    assert {r.id for r in Registry().list_runs()} == runs
    assert set(runs_dir().iterdir()) == folders


def test_a_queued_job_says_why_it_waits(targets, capsys):
    # slurm:held submits with --hold: Slurm keeps the job pending with reason JobHeldUser.
    from workbench.cli import main, status_table
    from workbench.widgets.job_view import JobView

    job = workbench.launch({"name": "held", "target": "slurm:held", **TINY})
    try:
        assert job.summary()["queue_reason"] == "JobHeldUser"
        row = status_table([job]).splitlines()[1]
        assert f"{job.id}  slurm:held  queued (JobHeldUser)" in row, row
        assert main(["status", job.id]) == 0
        assert "queue_reason: JobHeldUser" in capsys.readouterr().out
        assert "waiting: JobHeldUser" in JobView(job, autostart=False).stats.value
        # The lab panel's row for it carries the reason (the card shows "waiting: ...").
        from workbench_lab.view import RunsView

        rows = {r["id"]: r for r in RunsView(job.run_dir.path).runs()["runs"]}
        assert rows[job.id]["state"] == "queued"
        assert rows[job.id]["queue_reason"] == "JobHeldUser"
    finally:
        assert job.cancel() == "cancelled"
    _nothing_left(job.id)


# -- requeue and time limit ----------------------------------------------------------------------

def test_slurm_two_task_zero2_run_resumes_from_its_checkpoint_after_requeue(targets):
    # One node, two processes (one machine cannot host a second slurmd), DeepSpeed ZeRO-2,
    # requeued by the scheduler once a snapshot exists.
    job = workbench.launch({"name": "requeue", "target": "slurm:local",
                            "train": {"max_steps": 20, "lr": 3e-3},
                            "checkpoint": {"every_steps": 5}, "parallel": {"strategy": "zero2"}})
    script = (job.run_dir.path / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "srun" in script
    latest = job.run_dir.path / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not latest.exists():
        assert not job.done, job.logs(tail=30)
        time.sleep(0.5)
    assert latest.exists(), "no checkpoint appeared (checkpoint.every_steps: 5)"
    slurm_id = job.record.backend_job_id.split(":", 1)[1]
    subprocess.run(["scontrol", "requeue", slurm_id], check=True)
    assert job.wait(timeout=400, progress=False) == "succeeded", job.logs(tail=40)
    status = job.status()
    assert status["world_size"] == 2 and status["requeues"] >= 1
    assert "strategy: lora + zero2" in job.logs(tail=None, name="rank-0.log")
    raw = job.run_dir.metrics()  # every line both attempts wrote, resume marker included
    resumes = [i for i, m in enumerate(raw) if m.get("event") == "resume"]
    assert resumes, "the requeued attempt did not resume from a snapshot"
    resumed_at = raw[resumes[-1]]["step"]
    after = [m["step"] for m in raw[resumes[-1]:] if "loss" in m]
    # The second attempt continues after a checkpointed step (a multiple of 5), not at step 1.
    assert resumed_at > 0 and resumed_at % 5 == 0 and after[0] == resumed_at + 1, raw
    assert [m["step"] for m in job.metrics() if "loss" in m] == list(range(1, 21))
    logs = job.backend.logs(job.run_dir.path)
    out = logs[f"slurm-{slurm_id}.out"]
    assert "attempt 1" in out and "attempt 2" in out and "node-0.log" in logs
    _nothing_left(job.id)
    assert job.status()["slurm_state"] == "COMPLETED"


def test_a_cancel_after_a_budget_stop_keeps_the_budget_stop(lingering):
    stop = lingering[1]
    deadline = time.time() + 300
    while time.time() < deadline and stop.state != "budget_stopped":
        assert stop.state in ("queued", "running"), stop.logs(tail=30)
        time.sleep(1)
    assert stop.state == "budget_stopped", stop.logs(tail=30)
    # The job still runs (the wrapper lingers): a cancel now stops the job, not the run's record.
    assert stop.status()["slurm_state"] == "RUNNING"
    assert stop.cancel() == "budget_stopped"
    status = stop.status()
    assert status["slurm_state"] == "CANCELLED" and "budget limit reached" in status["note"]
    assert workbench.get_job(stop.id).state == "budget_stopped"
    _nothing_left(stop.id)


def test_a_success_recorded_before_the_time_limit_stands(lingering):
    # The success is recorded first; the time limit that ends the lingering job does not undo it.
    done = lingering[0]
    deadline = time.time() + 300
    while time.time() < deadline and done.status().get("slurm_state") != "TIMEOUT":
        time.sleep(1)
    status = done.status()
    assert status["slurm_state"] == "TIMEOUT" and status["state"] == "succeeded", status
    assert status.get("bundle"), status  # written after the outcome, and found by the reader
    assert (done.artefact() / "adapter_config.json").is_file()
    _nothing_left(done.id)


def test_time_limit_expiry_gives_a_clear_state(timeout_job):
    assert timeout_job.wait(timeout=240, progress=False) == "failed"
    status = timeout_job.status()
    assert status["slurm_state"] == "TIMEOUT"
    assert "time limit" in status["error"] and "raise 'time:' of slurm:short" in status["error"]
    _nothing_left(timeout_job.id)


def test_targets_file_is_where_home_says(tmp_path: Path, monkeypatch):
    # Another WORKBENCH_HOME: the targets of the session's home are gone, those written under
    # the new home are read, at call time.
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    assert target_names() == ["local"]
    with pytest.raises(TargetError, match="not configured"):
        get_target("ssh:pair")
    (tmp_path / "targets.yaml").write_text("ssh:\n  elsewhere:\n    hosts: [wb-node9]\n")
    assert target_names() == ["local", "ssh:elsewhere"]
    assert [h.host for h in get_target("ssh:elsewhere").hosts] == ["wb-node9"]
