"""DPO, ORPO, KTO and GRPO train for real through launch() on the built-in tiny model.

DPO runs in 2 processes (DDP over gloo) and is killed and resumed; KTO runs under ZeRO-2 in 2
processes; ORPO and GRPO run in one process. Steps and data are tiny: these check the path
(data, TRL trainer, our callbacks, snapshots, artefacts), not what the model learns (the
preference notebook does that).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

import workbench
from workbench.assets.teaching import teaching_rows
from workbench.procs import of_attempt

pytestmark = pytest.mark.slow

# Each teaching question with its answer chosen and another answer of the task rejected.
_ROWS = list(teaching_rows("train"))[:48]
_WRONG = {r["output"]: _ROWS[(i + 5) % len(_ROWS)]["output"] for i, r in enumerate(_ROWS)}


def _data(tmp_path_factory, stage: str) -> str:
    path = tmp_path_factory.mktemp(stage) / f"{stage}.jsonl"
    with path.open("w") as fh:
        for i, r in enumerate(_ROWS):
            wrong = _WRONG[r["output"]] if _WRONG[r["output"]] != r["output"] else "nothing"
            if stage == "pairs":
                row = {"prompt": r["instruction"], "chosen": r["output"], "rejected": wrong}
            elif stage == "unpaired":
                row = {"prompt": r["instruction"], "completion": r["output"] if i % 2 else wrong,
                       "label": bool(i % 2)}
            else:
                row = {"prompt": r["instruction"], "answer": r["output"]}
            fh.write(json.dumps(row) + "\n")
    return str(path)


def _spec(name: str, stage: str, data: str, steps: int, **extra) -> dict:
    spec = {"name": name, "method": {"stage": stage, **extra.pop("method", {})},
            "data": {"sources": [{"path": data}], "validation_fraction": 0.0, "max_length": 64},
            "train": {"max_steps": steps, "lr": 5e-3, "batch_size": 4, "eval_every": 0}}
    for section, values in extra.items():
        spec.setdefault(section, {}).update(values)
    return spec


def _train_lines(job) -> list[dict]:
    return [m for m in job.metrics() if "loss" in m and "event" not in m]


def _succeeded(job) -> None:
    assert job.wait(timeout=900, progress=False) == "succeeded", job.logs(tail=40)
    art = job.artefact()
    assert (art / "adapter_model.safetensors").is_file(), art
    assert json.loads((art / "workbench.json").read_text())["stage"] == job.spec.method.stage


DPO_STEPS = 8


@pytest.fixture(scope="module")
def dpo_job(tmp_path_factory):
    job = workbench.launch(_spec("dpo-ddp", "dpo", _data(tmp_path_factory, "pairs"), DPO_STEPS))
    _succeeded(job)
    return job


def test_dpo_in_two_processes_logs_reward_margins_and_accuracies(dpo_job):
    assert dpo_job.status()["world_size"] == 2
    lines = _train_lines(dpo_job)
    assert [m["step"] for m in lines] == list(range(1, DPO_STEPS + 1))
    for key in ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"):
        assert all(isinstance(m[key], float) for m in lines), key
    # The policy moves off its reference: margins start at 0 (policy == reference) and leave it.
    assert lines[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(m["rewards/margins"]) > 1e-4 for m in lines[1:])
    df = dpo_job.metrics_df()
    assert {"loss", "rewards/margins", "rewards/accuracies"} <= set(df.columns)
    assert "reference: implicit" in dpo_job.logs(tail=None, name="rank-0.log")


def test_dpo_killed_mid_run_resumes_on_the_same_curve(dpo_job, tmp_path_factory):
    job = workbench.launch(_spec("dpo-kill", "dpo", _data(tmp_path_factory, "pairs"), DPO_STEPS,
                                 checkpoint={"every_steps": 2, "keep": 2}))
    deadline = time.time() + 600
    while time.time() < deadline and ((job.status().get("snapshot") or {}).get("step") or 0) < 2:
        time.sleep(0.2)
    assert (job.status().get("snapshot") or {}).get("step"), job.logs(tail=20)
    victim = next(p for p in of_attempt(job.status()) if p.role == "rank" and p.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    _succeeded(job)
    assert job.status()["restarts"] == 1
    resumed = re.search(r"resuming from step-(\d+)", job.logs(tail=None, name="rank-0.log"))
    assert resumed, job.logs(tail=30, name="rank-0.log")
    a = {m["step"]: m for m in _train_lines(dpo_job)}
    b = {m["step"]: m for m in _train_lines(job)}
    assert sorted(b) == list(range(1, DPO_STEPS + 1))
    for step in range(int(resumed.group(1)) + 1, DPO_STEPS + 1):
        for key in ("loss", "rewards/margins"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)


def test_kto_under_zero2_in_two_processes(tmp_path_factory):
    job = workbench.launch(_spec("kto-zero2", "kto", _data(tmp_path_factory, "unpaired"), 3,
                                 parallel={"strategy": "zero2"}))
    _succeeded(job)
    assert "lora + zero2" in job.logs(tail=None, name="rank-0.log")
    lines = _train_lines(job)
    assert len(lines) == 3 and all("kl" in m for m in lines), lines[0]


def test_orpo_trains_with_no_reference(tmp_path_factory):
    job = workbench.launch(_spec("orpo", "orpo", _data(tmp_path_factory, "pairs"), 3,
                                 resources={"processes_per_node": 1}))
    _succeeded(job)
    lines = _train_lines(job)
    assert len(lines) == 3
    assert all("rewards/margins" in m and "rewards/accuracies" in m for m in lines), lines[0]


def test_grpo_with_a_rule_reward_logs_mean_reward_spread_and_kl(tmp_path_factory):
    job = workbench.launch(_spec(
        "grpo", "grpo", _data(tmp_path_factory, "prompts"), 2,
        method={"num_generations": 4, "max_completion_length": 8,
                "rewards": [{"fn": "length", "target_chars": 12}, {"fn": "exact_match"}]},
        resources={"processes_per_node": 1}))
    _succeeded(job)
    lines = _train_lines(job)
    assert len(lines) == 2
    for m in lines:
        assert {"reward", "reward_std", "kl", "rewards/length/mean",
                "rewards/exact_match/mean"} <= set(m)
        assert 0.0 <= m["rewards/length/mean"] <= 1.0
    # Random tokens differ in length, so the length reward has a spread to learn from.
    assert any(m["reward_std"] > 0 for m in lines)
