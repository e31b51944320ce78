"""Shared fixtures. Every test session gets its own WORKBENCH_HOME, so tests never touch the
user's runs and the notebooks executed by nbval (kernels inherit this environment) see it too."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="workbench-test-home-"))
os.environ["WORKBENCH_HOME"] = str(_HOME)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never depend on the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def wb_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def tiny_model(wb_home: Path) -> Path:
    from workbench.assets import builtin_model_path

    return builtin_model_path()


@pytest.fixture
def registry(tmp_path: Path):
    from workbench.registry import Registry

    return Registry(tmp_path / "registry.sqlite")


@pytest.fixture(scope="session")
def finished_job(wb_home: Path):
    """One finished real run (2 processes, 40 steps, the default evaluation schedule: what a
    newcomer gets; snapshots every 10 steps, the newest 2 kept), shared by every test that only
    reads a finished run: each real run costs the suite ~30 s."""
    import workbench

    job = workbench.launch({"name": "itest", "train": {"max_steps": 40, "lr": 3e-3},
                            "checkpoint": {"every_steps": 10, "keep": 2}})
    state = job.wait(timeout=600, progress=False)
    assert state == "succeeded", job.logs(tail=30)
    return job


@pytest.fixture(scope="session")
def served_run(wb_home: Path):
    """The run the vLLM tests deploy (tests/test_serve.py locally, tests/remote/test_remote_serve.py
    on SSH and Slurm): 20 epochs of the teaching set, so its greedy answers are the teaching
    answers and not garbage. Both modules compare what a server answers with transformers + peft
    on the same run, so one run serves both: each such run costs the suite ~1 min."""
    import workbench

    job = workbench.launch({"name": "serve-test", "train": {"epochs": 20, "lr": 3e-3}})
    assert job.wait(progress=False) == "succeeded", job.logs()
    return job


# The preference runs that test_preference_train.py and test_serve.py both read (after the
# home is set: their module imports workbench).
from tests.preference_runs import dpo_job, grpo_job, kto_job, orpo_job, user_reward  # noqa: E402,F401,I001
