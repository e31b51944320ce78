"""WORKBENCH_HOME: where the registry, runs and built-in assets live (default ~/.workbench)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    path = Path(os.environ.get("WORKBENCH_HOME", "~/.workbench")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def runs_dir() -> Path:
    path = home() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def assets_dir() -> Path:
    path = home() / "assets"
    path.mkdir(parents=True, exist_ok=True)
    return path
