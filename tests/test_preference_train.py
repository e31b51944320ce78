"""DPO, ORPO, KTO and GRPO train for real through launch() on the built-in tiny model.

Every stage runs in 2 processes: DPO, ORPO and GRPO under DDP over gloo, KTO under ZeRO-2. DPO
and GRPO (the stage with the most state: sampled completions and their rewards) are killed -9
and resumed; GRPO also scores with a user's reward function from a folder the ranks do not have
on their path (launch ships it with the run). Steps and data are tiny: these check the path
(data, TRL trainer, our callbacks, snapshots, artefacts), not what the model learns (the
preference notebook does that).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time

import pytest

import workbench
from tests.waiting import wait_for
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


def test_orpo_in_two_processes_trains_with_no_reference(tmp_path_factory):
    job = workbench.launch(_spec("orpo", "orpo", _data(tmp_path_factory, "pairs"), 3))
    _succeeded(job)
    assert job.status()["world_size"] == 2
    lines = _train_lines(job)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all("rewards/margins" in m and "rewards/accuracies" in m for m in lines), lines[0]
    assert "reference:" not in job.logs(tail=None, name="rank-0.log")


# -- GRPO: 2 processes, a user's reward shipped with the run, killed -9 and resumed -------------

GRPO_STEPS = 8
_USER_REWARD = textwrap.dedent("""
    print(f"wb_pref_reward imported from {__file__}", flush=True)

    def quarter(completions, **kwargs):
        return [0.25 for _ in completions]
    """)


@pytest.fixture(scope="module")
def user_reward(tmp_path_factory):
    """A reward module in a folder on this process's sys.path (as a notebook's own folder is)
    and NOT on the ranks' PYTHONPATH: the ranks can only import it if launch shipped it."""
    folder = tmp_path_factory.mktemp("user-rewards")
    (folder / "wb_pref_reward.py").write_text(_USER_REWARD)
    assert str(folder) not in os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("wb_pref_reward", None)


def _grpo_spec(name: str, data: str) -> dict:
    return _spec(name, "grpo", data, GRPO_STEPS,
                 method={"num_generations": 4, "max_completion_length": 8,
                         "rewards": [{"fn": "length", "target_chars": 12}, {"fn": "exact_match"},
                                     {"fn": "wb_pref_reward:quarter"}]},
                 checkpoint={"every_steps": 2, "keep": 2})


@pytest.fixture(scope="module")
def grpo_job(user_reward, tmp_path_factory):
    job = workbench.launch(_grpo_spec("grpo-ddp", _data(tmp_path_factory, "prompts")))
    _succeeded(job)
    return job


def test_grpo_in_two_processes_logs_rewards_spread_and_kl_with_a_shipped_user_reward(grpo_job):
    assert grpo_job.status()["world_size"] == 2
    lines = _train_lines(grpo_job)
    assert [m["step"] for m in lines] == list(range(1, GRPO_STEPS + 1))
    for m in lines:
        assert {"reward", "reward_std", "kl", "rewards/length/mean",
                "rewards/exact_match/mean"} <= set(m)
        assert 0.0 <= m["rewards/length/mean"] <= 1.0
        # The user's function scored every completion of both ranks (0.25 each, no spread).
        assert m["rewards/quarter/mean"] == pytest.approx(0.25)
        assert m["rewards/quarter/std"] == pytest.approx(0.0)
    # Random tokens differ in length, so the length reward has a spread to learn from.
    assert any(m["reward_std"] > 0 for m in lines)
    shipped = grpo_job.run_dir.path / "data" / "rewards" / "wb_pref_reward.py"
    assert shipped.read_text() == _USER_REWARD
    for rank in (0, 1):  # each rank imported the run's copy, not the notebook's folder
        assert f"wb_pref_reward imported from {shipped}" in grpo_job.logs(
            tail=None, name=f"rank-{rank}.log")


def test_grpo_killed_mid_run_resumes_from_its_snapshot_on_the_same_curve(grpo_job,
                                                                         tmp_path_factory):
    job = workbench.launch(_grpo_spec("grpo-kill", _data(tmp_path_factory, "prompts")))
    wait_for(lambda: ((job.status().get("snapshot") or {}).get("step") or 0) >= 2, 600,
             "the first GRPO snapshot")
    victim = next(p for p in of_attempt(job.status()) if p.role == "rank" and p.rank == 1)
    assert victim.signal(signal.SIGKILL), "rank 1 ended before it could be killed"
    _succeeded(job)
    assert job.status()["restarts"] == 1
    resumed = re.search(r"resuming from step-(\d+)", job.logs(tail=None, name="rank-0.log"))
    assert resumed, job.logs(tail=30, name="rank-0.log")
    at = int(resumed.group(1))
    assert 2 <= at < GRPO_STEPS  # killed mid-run, not after the last step
    raw = [m for m in job.run_dir.metrics() if "loss" in m or m.get("event") == "resume"]
    cut = next(i for i, m in enumerate(raw) if m.get("event") == "resume")
    assert raw[cut]["step"] == at
    # The first attempt trained from step 1; the second picked up right after the snapshot and
    # trained every later step once.
    assert [m["step"] for m in raw[:cut]][:at] == list(range(1, at + 1))
    assert [m["step"] for m in raw[cut + 1:]] == list(range(at + 1, GRPO_STEPS + 1))
    a, b = _train_lines(grpo_job), _train_lines(job)
    assert [m["step"] for m in b] == list(range(1, GRPO_STEPS + 1))
    # Sampling is seeded (per rank) and the snapshot holds every rank's RNG state, so the resumed
    # run samples the same completions and gets the same rewards as the uninterrupted one.
    for x, y in zip(a, b):
        for key in ("loss", "reward", "reward_std", "rewards/length/mean", "kl",
                    "completions/mean_length"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (x["step"], key)
