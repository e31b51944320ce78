"""Parallel strategies: the DeepSpeed config each one produces, and real ZeRO-2/3 runs on CPU."""

from __future__ import annotations

import json
import re

import pytest

import workbench
from workbench.runs.rundir import RunDir
from workbench.runs.snapshots import newest_verified
from workbench.spec import ParallelSpec, RunSpec
from workbench.train.strategy import (
    STALE_LOCK_S,
    clear_stale_extension_locks,
    deepspeed_config,
    resolved_parallel,
)


def test_ddp_has_no_deepspeed_config_and_zero_stages_do():
    assert deepspeed_config(ParallelSpec(strategy="ddp"), cuda=False) is None
    z2 = deepspeed_config(ParallelSpec(strategy="zero2", offload_optimizer=True), cuda=True)
    assert z2["zero_optimization"]["stage"] == 2
    assert z2["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "zero_force_ds_cpu_optimizer" not in z2  # on GPU, DeepSpeed's CPU Adam is the point
    z3 = deepspeed_config(ParallelSpec(strategy="zero3", offload_params=True), cuda=False)
    assert z3["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert z3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # Parameter offload exists only in stage 3.
    z1 = deepspeed_config(ParallelSpec(strategy="zero1", offload_params=True), cuda=False)
    assert "offload_param" not in z1["zero_optimization"]


def test_auto_reads_the_planners_choice_from_plan_json(tmp_path):
    spec = RunSpec()
    rd = RunDir(tmp_path / "run").create(spec)
    rd.plan_file.write_text(json.dumps({"strategy": {"parallel": "zero3", "offload_optimizer": True,
                                                     "offload_params": False}}))
    assert resolved_parallel(spec, rd) == ParallelSpec(strategy="zero3", offload_optimizer=True)
    explicit = spec.updated(**{"parallel.strategy": "zero1"})
    assert resolved_parallel(explicit, rd).strategy == "zero1"
    rd.plan_file.unlink()  # no plan recorded: ask the planner
    assert resolved_parallel(spec, rd).strategy == "ddp"


def test_locks_left_by_killed_builds_are_removed_and_live_ones_kept(tmp_path, monkeypatch,
                                                                     capsys):
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = time.time() - STALE_LOCK_S - 60
    stale = [tmp_path / "fused_adam" / "lock", tmp_path / "py311_cu121" / "cpu_adam" / "lock"]
    live = tmp_path / "cpu_adam" / "lock"  # another rank building right now
    for lock in [*stale, live]:
        lock.parent.mkdir(parents=True)
        lock.touch()
    for lock in stale:
        os.utime(lock, (old, old))
    assert sorted(clear_stale_extension_locks()) == sorted(stale)
    assert live.exists() and not any(lock.exists() for lock in stale)
    assert f"removed a stale build lock left by a killed build: {stale[0]}" in capsys.readouterr().out
    assert clear_stale_extension_locks() == []  # nothing left to do


def _plant_stale_build_lock(tmp_path, monkeypatch):
    """A JIT build of DeepSpeed's CPU shm op killed half-way leaves its lock file behind, and every
    later build waits on it forever (CI hung here). Plant one: the run must not build anything."""
    from workbench.train.strategy import SHM_COMM_OP

    stale = tmp_path / "torch_extensions" / SHM_COMM_OP
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return stale / "lock"


def _assert_adapter_trained(job) -> None:
    """The adapter saved under ZeRO holds real, trained weights (not empty ZeRO-3 shards)."""
    from workbench.serve.infer import load_chat_model

    model = load_chat_model(job).model
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.numel() > 0 for p in lora_b)
    assert any(p.abs().sum().item() > 0 for p in lora_b)


# Plain ZeRO-2 (no offload) has no run of its own here: ZeRO-1 below runs the same DeepSpeed
# optimizer class without offload, ZeRO-2 + offload below runs stage 2, and stage 2 without
# offload trains for real in the KTO test (tests/test_preference_train.py) and the Slurm
# requeue test (tests/remote/test_remote.py). A DeepSpeed run is among the suite's slowest tests
# (74-155 s each here on a loaded 2-core machine).
@pytest.mark.slow
def test_deepspeed_zero3_runs_on_cpu_with_two_ranks(tmp_path, monkeypatch):
    stale = _plant_stale_build_lock(tmp_path, monkeypatch)
    job = workbench.launch({"name": "ds-zero3", "train": {"max_steps": 15, "lr": 3e-3},
                            "parallel": {"strategy": "zero3"}, "checkpoint": {"every_steps": 10}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    assert stale.exists()  # fresh, so kept: the run simply built nothing
    assert "strategy: lora + zero3" in job.logs(tail=None, name="rank-0.log")
    # Partitioned at load (zero.Init inside from_pretrained): each of the 2 ranks holds about
    # half of the elements right after loading, never the whole model.
    for rank in (0, 1):
        log = job.logs(tail=None, name=f"rank-{rank}.log")
        held = re.search(r"zero3: loaded partitioned: this rank holds (\d+) of (\d+)", log)
        assert held, log[-2000:]
        local, total = int(held[1]), int(held[2])
        assert total > 100_000 and local <= total / 2 + 1000, (local, total)
    losses = [m["loss"] for m in job.metrics() if "loss" in m]
    assert len(losses) == 15 and losses[-1] < losses[0] - 1.0
    # DeepSpeed writes its own shards; the snapshot is still committed and verified.
    snap = newest_verified(job.run_dir)
    assert snap is not None and snap.name == "step-10"
    assert any(p.is_dir() for p in snap.iterdir())  # the engine's global_step folder
    _assert_adapter_trained(job)


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload", [("zero1", False), ("zero2", True)],
                         ids=["zero1", "zero2-offload-optimizer"])
def test_zero1_and_optimizer_offload_train_on_cpu(stage, offload, tmp_path, monkeypatch):
    import torch

    stale = _plant_stale_build_lock(tmp_path, monkeypatch)
    job = workbench.launch({"name": f"ds-{stage}{'-off' if offload else ''}",
                            "train": {"max_steps": 8, "lr": 3e-3},
                            "data": {"validation_fraction": 0.0},
                            "checkpoint": {"every_steps": 4},
                            "parallel": {"strategy": stage, "offload_optimizer": offload}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=30)
    assert stale.exists()  # fresh, so kept: the run simply built nothing
    log = job.logs(tail=None, name="rank-0.log")
    assert f"strategy: lora + {stage}{' (offload optimizer)' if offload else ''}" in log
    losses = [m["loss"] for m in job.metrics() if "loss" in m]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    # What DeepSpeed's engine itself saved: the config it ran with, and the optimizer state
    # partitioned into one shard per rank (plain DDP saves one whole optimizer.pt instead).
    snap = newest_verified(job.run_dir)
    assert snap is not None
    [engine_dir] = [p for p in snap.iterdir() if p.is_dir() and p.name.startswith("global_step")]
    shards = sorted(engine_dir.glob("*optim_states.pt"))
    assert [s.name.split("_mp_")[0] for s in shards] == ["zero_pp_rank_0", "zero_pp_rank_1"]
    assert not (snap / "optimizer.pt").exists()
    states = torch.load(next(engine_dir.glob("*model_states.pt")), map_location="cpu",
                        weights_only=False)
    zero = states["ds_config"]["zero_optimization"]
    assert zero["stage"] == int(stage[-1])
    assert (zero.get("offload_optimizer") or {}).get("device") == ("cpu" if offload else None)
    # Each rank holds about half of the fp32 master weights of the trainable (LoRA) parameters.
    held = []
    for shard in shards:
        osd = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        held.append(sum(t.numel() for t in osd["single_partition_of_fp32_groups"]))
    trainable = sum(t.numel() for n, t in states["module"].items() if "lora_" in n)
    assert sum(held) >= trainable and max(held) <= trainable / 2 + 64, (held, trainable)
    _assert_adapter_trained(job)
