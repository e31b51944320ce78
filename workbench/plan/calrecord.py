"""The stored calibration: its record, how steady its figures were, writing and reading it.

This module owns :class:`Calibration` (what a calibration measured, on which device, when and
how steady the readings were), :func:`store` (written atomically as
``WORKBENCH_HOME/calibration/TARGET.json``) and :func:`load_calibration`, which hands the planner
a stored calibration only for the device and dtype being planned: a file from another device or
dtype, or one that cannot be read, is reported (``CalibrationWarning``) and not used. Measuring is
:mod:`workbench.plan.calmeasure`'s; where the files live is :mod:`workbench.plan.calstore`'s.

    >>> Calibration("local", "2026-12-01", {}, "float32", 10.0, {"64": 5.0},
    ...             spread={"layers.64": 0.4}, readings=3).steadiness("layers.64")
    'unsteady: ±40 % between 3 readings'
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.plan.calmeasure import UNSTEADY
from workbench.plan.calstore import CalibrationError, CalibrationWarning, calibration_file

VERSION = 1


@dataclass
class Calibration:
    """Measured throughputs of one device, in GFLOP/s of the whole device (all cores of a CPU,
    one card of a GPU)."""

    target: str
    date: str  # ISO date of the measurement
    device: dict[str, Any]
    dtype: str
    matmul_gflops: float
    layers: dict[str, float] = field(default_factory=dict)  # hidden size -> fwd+bwd GFLOP/s
    version: int = VERSION
    # Parameters per second through gradient clipping + AdamW's step + zero_grad (fp32 state):
    # the optimizer step of full fine-tuning, memory-bound, not FLOPs. None: not measured.
    optimizer_params_per_s: float | None = None
    # How it was measured: "local measured" (calibrate() on the machine that stored it) or
    # "target probe" (workbench.plan.probe, on the target); where: the host or Slurm job.
    source: str = "local measured"
    where: str = ""
    # Bytes per second of weights made ready in memory at the load dtype (measure_load): the
    # start-up's load phase. None: not measured (workbench.runs.startup's default).
    load_bytes_per_s: float | None = None
    # Bytes per second of weights on the device written as a safetensors file (measure_save): the
    # finish's save of the trained weights. None: not measured (workbench.runs.startup's default).
    save_bytes_per_s: float | None = None
    # How steady each figure's readings were (calmeasure.steady): half their range over the
    # figure kept, by figure ("matmul", "layers.HIDDEN", "optimizer", "load", "save"); and how
    # many readings each figure keeps. Empty and 0: a file from before readings were kept.
    spread: dict[str, float] = field(default_factory=dict)
    readings: int = 0

    def train_gflops(self, hidden: int) -> tuple[float, int]:
        """(GFLOP/s of a forward+backward at the measured hidden size nearest ``hidden``, that
        size)."""
        if not self.layers:
            raise CalibrationError("this calibration has no layer measurement")
        h = min((int(k) for k in self.layers), key=lambda k: abs(k - hidden) / max(k, hidden))
        return self.layers[str(h)], h

    def steadiness(self, figure: str) -> str | None:
        """How steady ``figure``'s readings were, in words ("±3 % between 3 readings", or
        "unsteady: ±40 % ..." past ``UNSTEADY``); None when it was not recorded."""
        s = self.spread.get(figure)
        if s is None:
            return None
        count = f"{self.readings} " if self.readings else ""
        between = f"±{s * 100:.0f} % between {count}readings"
        return f"unsteady: {between}" if s > UNSTEADY else between

    def unsteady(self) -> dict[str, float]:
        """The figures whose readings spread wider than ``UNSTEADY``, with their spread."""
        return {k: v for k, v in self.spread.items() if v > UNSTEADY}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def store(cal: Calibration) -> Path:
    """Write ``cal`` as its target's calibration (atomically: a reader never sees half)."""
    path = calibration_file(cal.target)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)
    return path


def _checked(raw: Any) -> Calibration:
    """``raw`` (a stored file's JSON) as a Calibration; ValueError or TypeError when it is not
    one."""
    cal = Calibration(**raw)
    if not isinstance(cal.device, dict) or not isinstance(cal.layers, dict) or not isinstance(
            cal.spread, dict):
        raise TypeError("device, layers and spread must be mappings")
    if cal.source not in ("local measured", "target probe") or not isinstance(cal.where, str):
        raise ValueError(f"unknown source {cal.source!r}")
    cal.matmul_gflops = float(cal.matmul_gflops)
    cal.layers = {str(int(k)): float(v) for k, v in cal.layers.items()}
    cal.spread = {str(k): float(v) for k, v in cal.spread.items()}
    cal.readings = int(cal.readings)
    rates = ("optimizer_params_per_s", "load_bytes_per_s", "save_bytes_per_s")
    for rate in rates:
        if getattr(cal, rate) is not None:
            setattr(cal, rate, float(getattr(cal, rate)))
    if cal.matmul_gflops <= 0 or any(v <= 0 for v in cal.layers.values()) or any(
            v is not None and v <= 0 for v in (getattr(cal, r) for r in rates)):
        raise ValueError("throughputs must be positive")
    if any(v < 0 for v in cal.spread.values()) or cal.readings < 0:
        raise ValueError("spreads and the readings' count cannot be negative")
    return cal


def load_calibration(target: str, device: dict[str, Any] | None = None, dtype: str | None = None,
                     *, quiet: bool = False) -> Calibration | None:
    """The stored calibration of ``target``, or None: none stored, unreadable (warned), measured on
    another device than ``device`` or at another dtype than ``dtype`` (warned)."""
    path = calibration_file(target)
    if not path.is_file():
        return None

    def skip(why: str) -> None:
        if not quiet:
            warnings.warn(f"calibration {path} not used: {why}", CalibrationWarning, stacklevel=3)

    try:
        cal = _checked(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        skip(f"it cannot be read ({exc}); run `workbench targets check {target}` to measure "
             "again (the planner uses the GPU table meanwhile)")
        return None
    if device is not None and {k: cal.device.get(k) for k in device} != device:
        skip(f"it was measured on {_described(cal.device)}, the run is planned on "
             f"{_described(device)}; run `workbench targets check {target}` on that device")
        return None
    if dtype is not None and cal.dtype != dtype:
        skip(f"it was measured at {cal.dtype}, the run trains at {dtype}; run "
             f"workbench.plan.calibrate({target!r}, spec=spec)")
        return None
    return cal


def _described(device: dict[str, Any]) -> str:
    """A device identity (``device_identity``, or the part of it a plan asks for) in words."""
    if device.get("kind") == "gpu":
        return f"{device.get('gpu_type') or device.get('name') or 'unknown'} GPUs"
    if device.get("name"):
        return f"{device['name']} ({device.get('cores')} cores)"
    return "a CPU"
