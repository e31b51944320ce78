"""Export of a run on an SSH host (workbench/serve/export_remote.py) against the real loopback sshd
of tests/remote/cluster.py: the export runs on the host that holds the weights, and only the
folders asked for come back into the local run directory.

The run is trained on ``ssh:apart`` from a model folder only that target's home has
(``cluster_model``), so the merge can only happen there. The target's home has no llama.cpp
tools, so GGUF is first refused there before any work; with ``WORKBENCH_LLAMA_CPP`` in the
target's environment (the converter this machine unpacked) the same run exports merged + a q8_0
GGUF. The Slurm path shares this code with ``srun`` in front (the evaluation's allocation) and
is not run here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import workbench
from workbench.errors import ExportError
from workbench.serve import gguf as g
from workbench.targets.backends.ssh import SSHBackend
from workbench.targets.named import get_target

pytestmark = pytest.mark.slow


def _files(folder: Path) -> dict[str, bytes]:
    out = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = Path(top) / name
            out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def test_export_of_an_ssh_run_runs_on_its_host_and_brings_back_what_was_asked(
        targets, cluster_model, target_home):
    model_id, folder = cluster_model
    job = workbench.launch({"name": "export-ssh", "target": "ssh:apart",
                            "model": {"id": model_id}, "train": {"max_steps": 10, "lr": 3e-3}})
    assert job.wait(timeout=300, progress=False) == "succeeded", job.logs(tail=30)
    node0 = Path(json.loads((job.run_dir.path / "remote.json").read_text())["nodes"][0]["dir"])
    local = job.run_dir.path / "export"

    plan = job.export(["merged", "gguf"], quant=["q8_0"], plan_only=True)
    assert plan.where == "host wb-node0"
    assert plan.params == json.loads((job.run_dir.path / "plan.json").read_text())["params"]

    # The host has no llama.cpp tools (its home is not this one): refused there, before work.
    with pytest.raises(ExportError, match=r"on host wb-node0 \(where the run's weights are\): "
                                          r"GGUF export needs .*convert_hf_to_gguf.*make export-deps"):
        job.export(["merged", "gguf"], quant=["q8_0"], progress=False)
    assert not (node0 / "export").exists() or not any((node0 / "export").iterdir())
    assert not local.exists() or not any(local.iterdir())

    # The same target with the converter this machine unpacked in its environment.
    t = get_target("ssh:apart")
    tooled = t.model_copy(update={"env": {**t.env, "WORKBENCH_LLAMA_CPP": str(g.tools_dir())}})
    there = workbench.Job(job.record, backend=SSHBackend("ssh:apart", tooled))
    lines: list[str] = []
    report = there.export(["merged", "gguf"], quant=["q8_0"], progress=lines.append)
    assert lines[0].startswith(f"export of {job.id} on host wb-node0: needs about")
    assert any("exporting on host wb-node0" in ln for ln in lines), lines
    assert report.folders == {"merged": local / "merged", "gguf": local / "gguf"}
    # Written on the host (the merge read the base only it has), brought back byte for byte.
    for name in ("merged", "gguf"):
        assert _files(local / name) == _files(node0 / "export" / name), name
    assert sorted(p.name for p in (local / "gguf").iterdir()) == [
        "README.md", "export.json", "model-q8_0.gguf"]
    assert (local / "merged" / "model.safetensors").is_file()
    assert not [p for p in local.iterdir() if p.name.startswith(".")]  # no temporary folder
    checks = {c["file"]: c for c in report.checks}
    assert set(checks) == {"merged/", "gguf/model-q8_0.gguf"}
    assert checks["merged/"]["prompts"] == 8 and checks["merged/"]["token_agreement"] >= 0.9
    assert 0.0 <= checks["gguf/model-q8_0.gguf"]["token_agreement"] <= 1.0
    assert json.loads((local / "gguf" / "export.json").read_text())["checks"] == [
        checks["gguf/model-q8_0.gguf"]]
    status = job.status()["export"]
    assert status["where"] == "host wb-node0" and status["folders"]["gguf"] == str(local / "gguf")
    # The plan counted the parameters only; the sizes it gave are still near what was written.
    for name, planned in plan.files.items():
        got = sum(len(b) for k, b in _files(local).items() if k.startswith(name))
        assert abs(planned - got) <= 0.15 * got, (name, planned, got)
