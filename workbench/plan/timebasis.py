"""What the planner's clock stands on for one target: its calibration, or the GPU table.

This module owns :func:`time_basis`, which the planner asks for the throughput to time a step
with: the target's stored calibration (:mod:`workbench.plan.calrecord`) when it was measured on
the device being planned at the run's dtype, else the GPU table's peak at its stated
utilisation; the plan's line that says which, and how steady the calibration's readings were
("the clock of this machine is unsteady: ±40 % ..." past ``calmeasure.UNSTEADY``); and
:func:`device_key`, by which runs and step measurements of a target's device are grouped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from workbench.plan.calmeasure import UNSTEADY, device_identity
from workbench.plan.calrecord import Calibration, load_calibration


def device_key(target: str, on_gpu: bool, gpu_name: str) -> str:
    """The key the planner groups runs and step measurements of ``target``'s device by."""
    if on_gpu:
        return gpu_name
    if target == "local":
        ident = device_identity(False)
        return f"{ident['name']} x{ident['cores']}"
    return "CPU"  # a remote CPU target: only a measurement made there describes it


@dataclass(frozen=True)
class TimeBasis:
    """What the planner's clock stands on for one target: the GpuType whose peak x utilisation
    step_seconds uses, the plan's assumption line, the device key runs are grouped by, the
    measured optimizer parameters/s (None: not measured), and which calibration it used
    (``{"source": "local measured" | "target probe" | "default", "date", "where"}``)."""

    gpu: Any
    line: str
    device_key: str
    optimizer_rate: float | None
    calibration: dict[str, Any]
    load_rate: float | None = None  # measured bytes/s of weights made ready (measure_load)
    save_rate: float | None = None  # measured bytes/s of weights saved (measure_save)


def steadiness_line(cal: Calibration, hidden: int) -> str:
    """How steady the figures a step is timed from were (the layer at ``hidden``, the optimizer
    step), to follow the calibration's line: ", steady to ±3 % between 3 readings", or "; the
    clock of this machine is unsteady: ±40 % between readings of the optimizer step (...)" when
    one of them spread past ``UNSTEADY``; "" for a calibration that kept no spread. The load's
    and the save's (start-up and finish, seconds at most) are said by ``targets check``."""
    used = {f"layers.{hidden}": f"the hidden-{hidden} layer", "optimizer": "the optimizer step"}
    spreads = [(cal.spread[k], name) for k, name in used.items() if k in cal.spread]
    if not spreads:
        return ""
    worst, name = max(spreads)
    if worst > UNSTEADY:
        what = "this machine" if cal.target == "local" else cal.target
        return (f"; the clock of {what} is unsteady: ±{worst * 100:.0f} % between readings of "
                f"{name}, so this time is as unsteady (measure again when it is quieter: "
                f"`workbench targets check {cal.target}`)")
    said = cal.steadiness(f"layers.{hidden}")
    return f", steady to {said}" if said else ""


def time_basis(target: str, gpu: Any, on_gpu: bool, dtype: str, hidden: int,
               cores: int | None = None) -> TimeBasis:
    """The target's calibration when it was measured on this device at this dtype, else the GPU
    table's peak at its stated utilisation. ``cores``: the CPU cores per node the planner counts
    (its ``n_devices``), so a remote CPU node measured with another core count keeps its
    measured throughput per node."""
    key = device_key(target, on_gpu, gpu.name)
    if on_gpu:
        want: dict[str, Any] = {"kind": "gpu", "gpu_type": gpu.name}
    elif target == "local":
        want = {k: v for k, v in device_identity(False).items() if k in ("kind", "name", "cores")}
    else:  # a remote CPU target: only a calibration measured there describes it
        want = {"kind": "cpu"}
    cal = load_calibration(target, want, dtype)
    if cal is None:
        default = {"source": "default", "date": None, "where": None}
        if on_gpu:
            return TimeBasis(gpu, f"{gpu.name}: {gpu.bf16_tflops:g} TFLOP/s bf16 peak at "
                             f"{gpu.utilisation:.0%} utilisation (the GPU table; not calibrated)",
                             key, None, default)
        return TimeBasis(gpu, "CPU run: memory is host RAM shared by the processes; time at "
                         f"{gpu.utilisation:.0%} of {gpu.bf16_tflops} TFLOP/s per core (the GPU "
                         "table; not calibrated)", key, None, default)
    gflops, h = cal.train_gflops(hidden)
    units = 1 if on_gpu else max(1, int(cores or cal.device.get("cores") or 1))
    eff = dataclasses.replace(gpu, bf16_tflops=gflops / 1e3 / units, utilisation=1.0)
    if cal.source == "target probe":
        where = f"by a probe on {target}" + (f" ({cal.where})" if cal.where else "")
    else:
        where = "on this machine" if target == "local" else f"on {target}"
    return TimeBasis(eff, (f"calibrated {where} {cal.date}: {gflops:,.1f} GFLOP/s for a "
                           f"forward+backward of a hidden-{h} layer at {cal.dtype} "
                           f"({cal.device.get('name')}, {cal.device.get('cores')} "
                           f"{'GPUs' if on_gpu else 'cores'})" + steadiness_line(cal, h)),
                     key, cal.optimizer_params_per_s,
                     {"source": cal.source, "date": cal.date, "where": cal.where or None},
                     cal.load_bytes_per_s, cal.save_bytes_per_s)
