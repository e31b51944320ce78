"""``workbench targets setup`` against the real loopback sshd and the one-machine Slurm cluster.

Each set-up makes a venv in a fresh folder: over SSH for a host that reaches no registry (its
pip index is a closed port), so every wheel is downloaded here and carried over ssh, the torch
among them the CPU wheel this machine has; on Slurm inside a job, from the registry the node
reaches. Then `targets check` passes for the target and a tiny run trains in the new
environment. The wheels downloaded here are kept in WORKBENCH_HOME/wheelhouse for the session.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import workbench
from workbench.targets.check import check_target, notebook_versions
from workbench.targets.named import get_target, targets_file
from workbench.targets.setup import MARKER, SetupError, setup_target

pytestmark = pytest.mark.slow
TINY = {"train": {"max_steps": 6, "lr": 3e-3}}
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": "/dev/null"}


def _add_target(kind: str, name: str, body: dict) -> str:
    path = targets_file()
    raw = yaml.safe_load(path.read_text())
    raw.setdefault(kind, {})[name] = body
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return f"{kind}:{name}"


def _check(ref: str):
    report = check_target(ref)
    versions = [c for c in report.checks if c.name.startswith("versions")]
    return report, versions


def _trains(ref: str, venv: Path) -> workbench.Job:
    job = workbench.launch({"name": f"after-setup-{ref.split(':')[1]}", "target": ref, **TINY})
    assert job.wait(timeout=300, progress=False) == "succeeded", job.logs(tail=30)
    assert str(venv / "bin" / "python") in str(job.status().get("command")), job.status()
    return job


def test_ssh_setup_without_a_registry_carries_the_wheels(targets, tmp_path):
    venv = tmp_path / "env"
    base = targets["ssh"]["one"]
    body = {"hosts": ["wb-node0"], "ssh_config": base["ssh_config"],
            "workdir": str(tmp_path / "runs")}
    ref = _add_target("ssh", "fresh", {**body, "env": {**base["env"], **OFFLINE},
                                       "install": {"venv": str(venv), "torch_index": "none"}})
    lines: list[str] = []
    started = time.monotonic()
    done = setup_target(ref, progress=lines.append)
    took = time.monotonic() - started
    print(f"ssh set-up from carried wheels: {took:.0f} s")
    assert done.source == "wheels", lines
    assert any("copying" in ln and "MB" in ln for ln in lines), lines  # progress was shown
    assert any("uv pip install (wheels)" in ln for ln in lines), lines  # uv came with the wheels
    assert get_target(ref).python == str(venv / "bin" / "python")
    assert (venv / MARKER).is_file() and not (venv / ".workbench-partial").exists()
    here = notebook_versions()
    assert (done.workbench, done.torch) == (here["workbench"], here["torch"])
    report, versions = _check(ref)
    assert report.ok, report
    assert versions and versions[0].ok and "as in the notebook" in versions[0].detail, report
    _trains(ref, venv)

    # Drift: the target's Workbench is now another version; the check says so and what to run.
    meta = next(venv.glob("lib/python*/site-packages/workbench-*.dist-info/METADATA"))
    meta.write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.0.1", meta.read_text()))
    report, versions = _check(ref)
    assert not report.ok and "drift: workbench 0.0.1 there" in versions[0].detail, report
    assert f"workbench targets setup {ref}" in versions[0].fix
    started, seen = time.monotonic(), len(lines)
    setup_target(ref, progress=lines.append)  # the venv is kept: only Workbench is reinstalled
    print(f"ssh set-up again after drift: {time.monotonic() - started:.0f} s")
    # ... and only its wheel and the constraints are carried: the venv has every other wheel.
    assert any(re.search(r"copying 2 files \(\d+ MB\)", ln) for ln in lines[seen:]), lines[seen:]
    # The same requirements as before: the wheelhouse here already holds what they resolve to.
    assert not any("downloading the wheels" in ln for ln in lines[seen:]), lines[seen:]
    report, versions = _check(ref)
    assert report.ok and versions[0].ok, report

    # A set-up again that fails on the target (a torch no registry has) keeps what worked.
    _add_target("ssh", "fresh", {**body, "env": base["env"], "python": str(venv / "bin" / "python"),
                                 "install": {"venv": str(venv), "torch": "torch==0.0.1"}})
    with pytest.raises(SetupError, match="pip install failed.*set up before is kept") as info:
        setup_target(ref, progress=lines.append)
    assert "\n" not in str(info.value)
    assert (venv / MARKER).is_file() and not (venv / ".workbench-partial").exists()
    assert not Path(f"{venv}.setup").exists()
    assert get_target(ref).python == str(venv / "bin" / "python")
    subprocess.run([venv / "bin" / "python", "-c", "import workbench.runs.supervise, torch, peft"],
                   check=True)


def test_slurm_setup_runs_in_a_job_from_the_registry(targets, cluster, tmp_path):
    venv = tmp_path / "env"
    base = targets["slurm"]["local"]
    ref = _add_target("slurm", "fresh", {
        "env": base["env"], "time": "00:10:00",
        "install": {"venv": str(venv), "torch_index": "none"}})
    lines: list[str] = []
    started = time.monotonic()
    done = setup_target(ref, progress=lines.append)
    print(f"slurm set-up from the registry: {time.monotonic() - started:.0f} s")
    assert done.source == "registry", lines
    # This node's pip configuration (indexes, find-links, constraints, cert) is uv's to read.
    assert any("uv pip install (registry)" in ln for ln in lines), lines
    jobs = (cluster.root / "jobcomp.txt").read_text()
    assert "Name=wb-setup-fresh" in jobs  # the preflight and the install ran as Slurm jobs
    report, versions = _check(ref)
    assert report.ok and versions[0].ok, report
    job = _trains(ref, venv)
    assert f"PY={venv / 'bin' / 'python'}" in (job.run_dir.path / "slurm.sbatch").read_text()


def test_bad_input_is_one_line_and_a_failed_setup_records_nothing(targets, tmp_path, monkeypatch):
    base = targets["ssh"]["one"]
    ssh = {"hosts": ["wb-node0"], "ssh_config": base["ssh_config"], "env": base["env"],
           "python": base["python"]}

    def refused(ref: str, match: str) -> str:
        with pytest.raises(SetupError, match=match) as info:
            setup_target(ref, progress=lambda _: None)
        assert "\n" not in str(info.value), str(info.value)
        return str(info.value)

    refused("ssh:nosuch", "not configured")
    refused(_add_target("ssh", "ro", {**ssh, "install": {"venv": "/proc/wb-env"}}),
            "cannot write /proc/wb-env.*install.venv")
    # A Python without venv, as Debian's is without python3-venv: ensurepip does not import.
    fake = tmp_path / "no-ensurepip"
    fake.mkdir()
    (fake / "ensurepip.py").write_text("raise ImportError(\"No module named 'ensurepip'\")\n")
    refused(_add_target("ssh", "novenv", {**ssh, "env": {**ssh["env"], "PYTHONPATH": str(fake)},
                                          "install": {"venv": str(tmp_path / "e1")}}),
            "has no venv module.*apt install python3-venv")
    offline = {**ssh, "env": {**ssh["env"], **OFFLINE}}
    refused(_add_target("ssh", "noreg", {**offline, "install": {"venv": str(tmp_path / "e2"),
                                                                 "source": "registry"}}),
            "reaches no registry.*install.source")
    # No registry there and none here either (a fresh wheel cache, pip offline on this machine).
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(targets_file(), home / "targets.yaml")
    with monkeypatch.context() as m:
        m.setenv("WORKBENCH_HOME", str(home))
        for k, v in {**OFFLINE, "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}.items():
            m.setenv(k, v)
        ref = _add_target("ssh", "nowheels", {**offline, "install": {"venv": str(tmp_path / "e3"),
                                                                      "source": "wheels"}})
        refused(ref, "no registry there and no wheels here.*install.wheels")
    # An install that fails on the target: the venv it began is gone, nothing is recorded.
    venv = tmp_path / "e4"
    ref = _add_target("ssh", "fails", {**ssh, "install": {"venv": str(venv),
                                                          "torch": "torch==0.0.1"}})
    refused(ref, "set-up failed, nothing recorded: uv pip install failed")
    assert not venv.exists() and not Path(f"{venv}.setup").exists()
    assert get_target(ref).python == base["python"]
