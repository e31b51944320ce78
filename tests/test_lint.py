"""The style guide's "ruff + mypy clean", kept true by the test command rather than by memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "workbench", "tests", "bench")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing_in_the_package():
    out = _run("mypy", "workbench")
    assert out.returncode == 0, out.stdout + out.stderr
