"""Where calibrations are kept, and their error and warning: the ground both the target
calibration (:mod:`workbench.plan.calibrate`) and the measured step
(:mod:`workbench.plan.stepclock`) stand on, so neither imports the other for it.

    >>> calibration_file("slurm:gpu").name  # doctest: +SKIP
    'slurm_gpu.json'
"""

from __future__ import annotations

import re
from pathlib import Path

from workbench.errors import WorkbenchError


class CalibrationWarning(UserWarning):
    """A stored calibration cannot be used (unreadable, or from another device)."""


class CalibrationError(WorkbenchError):
    """The measurement itself cannot run here (no torch, an unknown dtype, a broken device)."""


def calibration_dir() -> Path:
    from workbench.runs.home import home

    path = home() / "calibration"
    path.mkdir(parents=True, exist_ok=True)
    return path


def calibration_file(target: str) -> Path:
    return calibration_dir() / (re.sub(r"[^A-Za-z0-9_.-]", "_", target) + ".json")
