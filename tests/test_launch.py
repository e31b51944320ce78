"""Real training through the one launch path: 2 processes (gloo) on the built-in tiny model.

Each test here starts real torchrun jobs, so they are the slow part of the suite (~30 s each on
two CPU cores); the finished run (tests/conftest.py: finished_job) is shared by the tests here
and elsewhere that only read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

import workbench
from tests.waiting import wait_for
from workbench.errors import (
    DatasetFormatError,
    EmptyDatasetError,
    ModelNotFoundError,
    ResourceError,
    SpecError,
)
from workbench.runs.home import runs_dir
from workbench.runs.registry import Registry

pytestmark = pytest.mark.slow


def test_two_process_run_completes_with_falling_loss(finished_job):
    job = finished_job
    status = job.status()
    assert status["state"] == "succeeded" and status["world_size"] == 2
    assert status["step"] == status["total_steps"] == 40
    # On CPU no CUDA-only fast path is asked for; the tiny Llama gets transformers' SDPA.
    assert status["fast_paths"] == "fast paths: liger off, sdpa, adamw, tf32 off"
    rows = job.metrics()
    train = [m for m in rows if "loss" in m]
    assert [m["step"] for m in train] == list(range(1, 41))
    first = sum(m["loss"] for m in train[:5]) / 5
    last = sum(m["loss"] for m in train[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert all(m["tokens_per_s"] > 0 for m in train[1:])
    assert any("eval_loss" in m for m in rows)
    art = job.artefact()
    assert art.name == "adapter" and (art / "adapter_config.json").is_file()
    assert (art / "adapter_model.safetensors").is_file() and (art / "tokenizer.json").is_file()
    logs = {p.name for p in job.run_dir.log_files()}
    assert {"rank-0.log", "rank-1.log", "launcher.log", "supervisor.log"} <= logs
    for rank in ("rank-0.log", "rank-1.log"):  # no copy of the weights by the Trainer's set-up
        assert "weights: trained where they were loaded" in (job.run_dir.logs_dir / rank
                                                             ).read_text()
    assert list((job.run_dir.tb_dir).rglob("events.out.tfevents.*"))
    assert Registry().get_run(job.id).state == "succeeded"
    df = job.metrics_df()
    assert {"step", "loss", "lr", "grad_norm"} <= set(df.columns)
    # A standby start: the supervisor started before launch created the run directory, and the
    # bill runs from its start, so it covers every process of the attempt from theirs.
    sup = next(p["create_time"] for p in status["processes"] if p["role"] == "supervisor")
    assert sup < status["created"]
    assert status["attempt_started"] <= min(p["create_time"] for p in status["processes"])
    assert status["billed_s"] >= status["ended"] - sup - 0.5


# Cancelling a run mid-training: tests/test_budget.py (a cancelled run's bill and resume).


def test_cli_launch_then_reattach_after_the_launcher_is_gone(tmp_path):
    spec = workbench.RunSpec(name="detached", method={"kind": "full"},
                             train={"max_steps": 12, "lr": 1e-3})
    path = spec.save(tmp_path / "spec.yaml")
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", str(path)],
                         capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[1]
    # The process that launched the run has exited; a new handle finds the run and follows it.
    job = workbench.get_job(run_id)
    assert job.id in [j.id for j in workbench.jobs()]
    assert job.wait(timeout=300, progress=False) == "succeeded", job.logs(tail=20)
    model = job.artefact()
    assert model.name == "model" and (model / "config.json").is_file()
    assert json.loads((model / "workbench.json").read_text())["method"] == "full"


# A failing run's error text: tests/test_trust_procs.py (its root cause, over two attempts).


def _standbys() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("workbench-standby-*"))


def _nothing_written(before_runs: set, before_registry: int, before_children: set | None = None,
                     before_standbys: set | None = None) -> None:
    assert set(runs_dir().iterdir()) == before_runs
    assert len(Registry().list_runs()) == before_registry
    if before_children is not None:  # a refused launch leaves no process behind: no standby
        left = set(psutil.Process().children(recursive=True)) - before_children
        assert not left, [p.cmdline() for p in left]
    if before_standbys is not None:
        assert _standbys() <= before_standbys


def test_launch_refuses_a_plan_that_cannot_fit_unless_forced():
    from workbench.plan import PlanError

    before_runs, before_reg = set(runs_dir().iterdir()), len(Registry().list_runs())
    spec = {"name": "too-big", "model": {"id": "meta-llama/Llama-2-7b-hf"},
            "method": {"kind": "full"}, "parallel": {"strategy": "ddp"}}
    with pytest.raises(PlanError) as info:
        workbench.launch(spec)  # 7B full fine-tuning in two CPU processes: ~100 GB each
    assert "does not fit" in str(info.value).lower() and "force" in str(info.value)
    # Forced past the plan, it still stops before starting: the weights are out of reach here.
    with pytest.raises(ModelNotFoundError, match="hub is reachable"):
        workbench.launch(spec, force=True)
    _nothing_written(before_runs, before_reg)


@pytest.mark.parametrize("kind", ["model", "field", "empty", "gpus", "typo", "qlora", "wandb"])
def test_bad_inputs_fail_before_anything_starts(kind, tmp_path, monkeypatch):
    # The same answers on any machine: GPU cases see a machine without CUDA, the W&B case one
    # without wandb, whatever is really installed here.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec("wandb") -> None: not installed
    before_runs, before_reg = set(runs_dir().iterdir()), len(Registry().list_runs())
    before_children, before_standbys = set(psutil.Process().children(recursive=True)), _standbys()
    bad_field = tmp_path / "train.jsonl"
    bad_field.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "q2"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        "model": ({"model": {"id": str(tmp_path / "no-model")}}, ModelNotFoundError,
                  "not a folder on this machine"),
        "field": ({"data": {"sources": [{"path": str(bad_field)}]}}, DatasetFormatError,
                  'line 2 of train.jsonl has no "output" field'),
        "empty": ({"data": {"sources": [{"path": str(empty)}]}}, EmptyDatasetError, "no rows"),
        "gpus": ({"resources": {"gpus_per_node": 2}}, ResourceError,
                 "resources.gpus_per_node is 2 but this machine has none"),
        "typo": ({"train": {"epoch": 2}}, SpecError, "did you mean 'epochs'"),
        "qlora": ({"method": {"kind": "qlora"}}, ResourceError, "needs a CUDA GPU"),
        "wandb": ({"tracking": {"wandb": "offline"}}, workbench.LaunchError,
                  "wandb is not installed"),
    }
    spec, exc, fragment = cases[kind]
    with pytest.raises(exc) as info:
        workbench.launch(spec)
    assert fragment in str(info.value)
    _nothing_written(before_runs, before_reg, before_children, before_standbys)


def test_a_standby_ends_with_the_process_that_launched_it():
    # The launching process (a kernel, the CLI) dies while its standby's ranks still wait for
    # the go: the standby must not outlive it.
    code = ("import time, workbench; from workbench.runs.standby import Standby; "
            "s = Standby.start(workbench.RunSpec()); print(s.proc.pid, s.folder, flush=True); "
            "time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    pid, folder = launcher.stdout.readline().split()
    supervisor = psutil.Process(int(pid))

    def waiting_ranks() -> list[psutil.Process]:
        return [p for p in supervisor.children(recursive=True)
                if "workbench.train" in p.cmdline() and "--standby" in p.cmdline()
                and p.ppid() != supervisor.pid]

    wait_for(lambda: len(waiting_ranks()) == 2, 120, "the standby's two ranks")
    tree = [supervisor, *supervisor.children(recursive=True)]
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs(tree, timeout=120)
    assert not alive, [p.cmdline() for p in alive]
    assert not Path(folder).exists()
