"""Preference runs shared by the whole test session: their data, specs, and the finished DPO,
ORPO, KTO and GRPO runs that both tests/test_preference_train.py (curves, kill and resume) and
tests/test_serve.py (their adapters served by vLLM) read. Each real run costs the suite tens of
seconds, so a session trains each of these once (tests/conftest.py registers the fixtures).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

import workbench
from tests.waiting import wait_for
from workbench.assets.teaching import teaching_rows
from workbench.runs.procs import of_attempt

# Each teaching question with its answer chosen and another answer of the task rejected.
_ROWS = list(teaching_rows("train"))[:48]
_WRONG = {r["output"]: _ROWS[(i + 5) % len(_ROWS)]["output"] for i, r in enumerate(_ROWS)}

DPO_STEPS = 8
ORPO_STEPS = 16
KTO_STEPS = 12
GRPO_STEPS = 8
KILL_CHECKPOINT = {"every_steps": 2, "keep": 2}  # DPO's and GRPO's killed runs
# ORPO's and KTO's runs are killed once a step past their snapshot (every 5 steps) is logged (they
# hold there: launch_held), so the steps after the snapshot are trained twice, before and after
# the kill.
ONE_SNAPSHOT = {"every_steps": 5, "keep": 2}


def pref_data(tmp_path_factory, stage: str) -> str:
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


def pref_spec(name: str, stage: str, data: str, steps: int, **extra) -> dict:
    spec = {"name": name, "method": {"stage": stage, **extra.pop("method", {})},
            "data": {"sources": [{"path": data}], "validation_fraction": 0.0, "max_length": 64},
            "train": {"max_steps": steps, "lr": 5e-3, "batch_size": 4, "eval_every": 0}}
    for section, values in extra.items():
        spec.setdefault(section, {}).update(values)
    return spec


def succeeded(job) -> None:
    assert job.wait(timeout=900, progress=False) == "succeeded", job.logs(tail=40)
    art = job.artefact()
    assert (art / "adapter_model.safetensors").is_file(), art
    assert json.loads((art / "workbench.json").read_text())["stage"] == job.spec.method.stage


def train_lines(job) -> list[dict]:
    return [m for m in job.metrics() if "loss" in m and "event" not in m]


def launch_held(spec: dict, after: int, folder: Path) -> tuple[workbench.Job, Path]:
    """``spec`` launched to hold before each step past ``after`` while the hold file returned
    exists (HOLD_ENV): a kill lands on a live run at a known step, whatever the machine's speed."""
    from workbench.train.callbacks import HOLD_ENV  # imports transformers: not at conftest's load

    hold = folder / f"hold-{spec['name']}"
    hold.write_text(str(after))
    os.environ[HOLD_ENV] = str(hold)  # the run's processes take it from the launching one
    try:
        return workbench.launch(spec), hold
    finally:
        os.environ.pop(HOLD_ENV)


def kill_rank_1_and_resume(job, hold: Path, steps: int, snapshot: int = 2,
                           past: bool = False) -> int:
    """Kill rank 1 with SIGKILL once the run (launched by launch_held, to hold at step
    ``snapshot``, or the step after it with ``past``) has a snapshot at step ``snapshot`` or
    later (and, with ``past``, has also logged a step after it, its snapshots being every
    ``snapshot`` steps), let it go on, wait for the automatic restart to finish the run, check it
    resumed from that snapshot and logged every later step once, and return the step it resumed
    from."""

    def ready() -> bool:
        at = (job.status().get("snapshot") or {}).get("step") or 0
        if at < snapshot or not past:
            return at >= snapshot
        # Snapshots are taken every ``snapshot`` steps and committed in the background, so the
        # status may name one while the next is already being written: kill only between a step
        # logged past the snapshot and the step that starts the next one.
        last = max((m["step"] for m in train_lines(job)), default=0)
        return at < last < at + snapshot

    try:
        wait_for(ready, 600, f"the snapshot of {job.name} at step {snapshot}")
        victim = next(p for p in of_attempt(job.status()) if p.role == "rank" and p.rank == 1)
        assert victim.signal(signal.SIGKILL), "rank 1 ended before it could be killed"
    finally:
        hold.unlink()  # the restarted ranks (seconds later) train on through
    succeeded(job)
    assert job.status()["restarts"] == 1
    resumed = re.search(r"resuming from step-(\d+)", job.logs(tail=None, name="rank-0.log"))
    assert resumed, job.logs(tail=30, name="rank-0.log")
    at = int(resumed.group(1))
    assert 2 <= at < steps  # killed mid-run, not after the last step
    raw = [m for m in job.run_dir.metrics() if "loss" in m or m.get("event") == "resume"]
    cut = next(i for i, m in enumerate(raw) if m.get("event") == "resume")
    assert raw[cut]["step"] == at
    # The first attempt trained from step 1; the second picked up right after the snapshot and
    # trained every later step once.
    assert [m["step"] for m in raw[:cut]][:at] == list(range(1, at + 1))
    assert [m["step"] for m in raw[cut + 1:]] == list(range(at + 1, steps + 1))
    assert [m["step"] for m in train_lines(job)] == list(range(1, steps + 1))
    return at


@pytest.fixture(scope="session")
def dpo_job(tmp_path_factory):
    """DPO in 2 processes (DDP), uninterrupted: 8 steps on the tiny model, LoRA."""
    job = workbench.launch(pref_spec("dpo-ddp", "dpo", pref_data(tmp_path_factory, "pairs"),
                                     DPO_STEPS))
    succeeded(job)
    return job


@pytest.fixture(scope="session")
def orpo_job(tmp_path_factory):
    """ORPO in 2 processes (DDP), killed -9 after its one snapshot and after a step past it, and
    resumed: its test compares the steps trained twice; test_serve.py serves its adapter."""
    every = ONE_SNAPSHOT["every_steps"]
    job, hold = launch_held(pref_spec("orpo", "orpo", pref_data(tmp_path_factory, "pairs"),
                                      ORPO_STEPS, checkpoint=ONE_SNAPSHOT), every + 1,
                            tmp_path_factory.mktemp("hold"))
    kill_rank_1_and_resume(job, hold, ORPO_STEPS, every, past=True)
    return job


@pytest.fixture(scope="session")
def kto_job(tmp_path_factory):
    """KTO in 2 processes under ZeRO-2, killed -9 after its one snapshot and a step past it, and
    resumed: its test compares the steps trained twice; test_serve.py serves its adapter."""
    every = ONE_SNAPSHOT["every_steps"]
    job, hold = launch_held(pref_spec("kto-zero2", "kto", pref_data(tmp_path_factory, "unpaired"),
                                      KTO_STEPS, parallel={"strategy": "zero2"},
                                      checkpoint=ONE_SNAPSHOT), every + 1,
                            tmp_path_factory.mktemp("hold"))
    kill_rank_1_and_resume(job, hold, KTO_STEPS, every, past=True)
    return job


# GRPO scores with a user's reward function from a folder the ranks do not have on their path.
USER_REWARD = textwrap.dedent("""
    print(f"wb_pref_reward imported from {__file__}", flush=True)

    def quarter(completions, **kwargs):
        return [0.25 for _ in completions]
    """)


@pytest.fixture(scope="session")
def user_reward(tmp_path_factory):
    """A reward module in a folder on this process's sys.path (as a notebook's own folder is)
    and NOT on the ranks' PYTHONPATH: the ranks can only import it if launch shipped it."""
    folder = tmp_path_factory.mktemp("user-rewards")
    (folder / "wb_pref_reward.py").write_text(USER_REWARD)
    assert str(folder) not in os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("wb_pref_reward", None)


def grpo_spec(name: str, data: str) -> dict:
    return pref_spec(name, "grpo", data, GRPO_STEPS,
                     method={"num_generations": 4, "max_completion_length": 8,
                             "rewards": [{"fn": "length", "target_chars": 12},
                                         {"fn": "exact_match"}, {"fn": "wb_pref_reward:quarter"}]},
                     checkpoint=KILL_CHECKPOINT)


@pytest.fixture(scope="session")
def grpo_job(user_reward, tmp_path_factory):
    """GRPO in 2 processes (DDP), uninterrupted; test_serve.py serves its adapter."""
    job = workbench.launch(grpo_spec("grpo-ddp", pref_data(tmp_path_factory, "prompts")))
    succeeded(job)
    return job
