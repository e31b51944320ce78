"""Shared fixtures. Every test session gets its own WORKBENCH_HOME, so tests never touch the
user's runs and the notebooks executed by nbval (kernels inherit this environment) see it too."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="workbench-test-home-"))
os.environ["WORKBENCH_HOME"] = str(_HOME)
# The machine's GPU leases (shared by every home) for this session only: nothing of the real
# machine's leases is read or left behind.
os.environ["WORKBENCH_LEASES"] = str(_HOME / "machine-gpu-leases")

# Children that import test helpers by name (multiprocessing's spawn) find the tests package
# through a folder holding only a link to it: the checkout's root stays off every sys.path, so
# its other top-level folders (kernels/) are not importable (tests/test_lint.py).
_TESTS_ONLY = Path(tempfile.mkdtemp(prefix="workbench-tests-pkg-"))
(_TESTS_ONLY / "tests").symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
sys.path.append(str(_TESTS_ONLY))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never depend on the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that start a real server, cluster or browser (the course hub, the Slurm cluster and
# sshd, the lab server and its browser page, vLLM) or a shared real run, or need vLLM's own
# environment (`make serve-env`, which `make test-fast` does not build): a test that uses one,
# directly or through other fixtures, is marked slow. Fixtures and tests that launch a run
# themselves are found by what they call (_launches), so a new one needs no entry here.
SLOW_FIXTURES = frozenset({"finished_job", "served_run", "hub", "cluster", "lab_server", "page",
                           "servers", "lab", "serve_python"})


@functools.cache
def _launches(path: str) -> frozenset[str]:
    """Names of the functions in the module at ``path`` that start a real run: they call
    ``workbench.launch`` (or ``launch``) outside ``pytest.raises`` (a refused launch starts
    nothing), or call such a function of the same module."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found: set[str] = set()

    def calls(node: ast.AST) -> bool:
        if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and ast.unparse(i.context_expr.func)
                == "pytest.raises" for i in node.items):
            return False
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("workbench.launch", "launch") or name in found:
                return True
        return any(calls(child) for child in ast.iter_child_nodes(node))

    while True:
        more = {f.name for f in funcs if f.name not in found and calls(f)}
        if not more:
            return frozenset(found)
        found |= more


def _starts_a_run(func: Callable[..., Any]) -> bool:
    try:
        path = inspect.getsourcefile(func)
    except TypeError:  # a built-in
        return False
    return path is not None and getattr(func, "__name__", "") in _launches(path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session that passed takes its home with it (its runs, calibrations and the target set-up
    tests' wheelhouse: hundreds of MB a session); a failed one's stays for its logs, and the
    summary says where (every session fixture has ended by now)."""
    if exitstatus == 0:
        shutil.rmtree(_HOME, ignore_errors=True)
        shutil.rmtree(_TESTS_ONLY, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    if exitstatus != 0 and _HOME.exists():
        terminalreporter.write_line(f"the session's WORKBENCH_HOME (runs and their logs): {_HOME}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow (what `make test-fast` leaves out) each test that starts a real run or server:
    itself, or through a fixture it uses (SLOW_FIXTURES, or one that launches a run)."""
    for item in items:
        if item.get_closest_marker("slow") or not isinstance(item, pytest.Function):
            continue
        info = item._fixtureinfo
        fixtures = [d.func for defs in info.name2fixturedefs.values() for d in defs]
        if (SLOW_FIXTURES & set(item.fixturenames) or _starts_a_run(item.function)
                or any(_starts_a_run(f) for f in fixtures)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def wb_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def tiny_model(wb_home: Path) -> Path:
    from workbench.assets import builtin_model_path

    return builtin_model_path()


@pytest.fixture
def registry(tmp_path: Path):
    from workbench.runs.registry import Registry

    return Registry(tmp_path / "registry.sqlite")


@pytest.fixture(scope="session")
def students_reach():
    """For the session, other users may traverse down to what the course tests' Unix users'
    processes import, wherever the clone lives (tests/course/reach.py); modes restored after."""
    from tests.course.reach import reachable, students_imports

    with reachable(students_imports()) as changed:
        yield changed


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
