"""Calibration: what a target really achieves for training-shaped work, measured and stored.

:func:`calibrate` times, with torch at the run's dtype, a square matrix product and a forward and
backward pass of a transformer MLP block (``hidden -> 4 hidden -> hidden``, SiLU) at a few hidden
sizes (and the model's own, given a spec), the optimizer step, and the weights' load and save,
and writes ``WORKBENCH_HOME/calibration/TARGET.json`` with the date, the device it ran on (CPU
model and core count, or GPU name) and how steady each figure's readings were. ``workbench
targets check local`` runs it; a fresh home's first CPU plan runs it once
(:func:`first_plan_here`); a remote target is measured on the target itself by
:mod:`workbench.plan.probe` (:func:`measure_here`, run there).

This module puts a calibration together and is the import path for all of it. Its parts:
:mod:`~workbench.plan.calmeasure` times (each figure the median of several readings after a
warm-up, with their spread), :mod:`~workbench.plan.calrecord` is the stored record (and
:func:`load_calibration`, which gives the planner the stored figures only for the device being
planned), :mod:`~workbench.plan.timebasis` is what the planner's clock stands on (the
calibration or the GPU table's peak times its stated utilisation, and how steady it was).

    >>> calibrate("local").train_gflops(64)  # doctest: +SKIP
    (3.1, 64)
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any

# Re-exported: callers import these names from here.
from workbench.plan.calmeasure import (  # noqa: F401
    _CPU_HIDDENS,
    _GPU_HIDDENS,
    READINGS,
    UNSTEADY,
    device_identity,
    measure,
    measure_load,
    measure_optimizer,
    measure_save,
    steady,
)
from workbench.plan.calrecord import (  # noqa: F401
    VERSION,
    Calibration,
    load_calibration,
    store,
)
from workbench.plan.calstore import (  # noqa: F401
    CalibrationError,
    CalibrationWarning,
    calibration_dir,
    calibration_file,
)
from workbench.plan.timebasis import TimeBasis, device_key, time_basis  # noqa: F401

PROBE_TAG = "WORKBENCH-CALIBRATION "  # the line the probe's remote side prints its figures on


def calibrate(target: str = "local", *, spec: Any = None, dtype: str | None = None) -> Calibration:
    """Measure this machine for ``target`` and store it (WORKBENCH_HOME/calibration/TARGET.json).

    With a spec, the model's hidden size and the run's dtype are measured too, and the stored
    layer figures of other sizes are kept. Only the machine this runs on can be measured: a
    remote target's calibration is written by a process on that target. ``spec``: a RunSpec, a
    dict or a YAML path, as ``plan`` and ``launch`` take it."""
    if spec is not None:
        from workbench.spec import RunSpec

        spec = RunSpec.coerce(spec)
    on_gpu = bool(spec is not None and spec.resources.gpus_per_node > 0)
    if spec is None:
        try:
            import torch

            on_gpu = torch.cuda.is_available()
        except ImportError:
            on_gpu = False
    if dtype in (None, "auto"):  # what the run's matmuls use: the trainer's and planner's resolver
        from workbench.spec.precision import local_device_kind, resolve_precision

        device = local_device_kind() if on_gpu else "cpu"
        wanted = spec.model.dtype if spec is not None and dtype is None else "auto"
        dtype = resolve_precision(wanted,
                                  spec.method.kind if spec is not None else "lora",
                                  device).compute_dtype
    hiddens: tuple[int, ...] = ()
    old = load_calibration(target, quiet=True)
    if spec is not None:
        from workbench.plan.shape import model_shape

        hidden = model_shape(spec.model.id, spec.model.revision,
                             spec.model.trust_remote_code).hidden
        hiddens = (hidden,) if old is not None and old.dtype == dtype else (
            *(_GPU_HIDDENS if on_gpu else _CPU_HIDDENS), hidden)
    cal = measure_here(target, on_gpu, dtype, hiddens, old)
    store(cal)
    if spec is not None:  # the run's own step, which the planner prefers (workbench.plan.stepclock)
        _calibrate_step(target, spec, on_gpu, dtype, cal)
    return cal


def _calibrate_step(target: str, spec: Any, on_gpu: bool, dtype: str, cal: Calibration) -> None:
    from workbench.plan.shape import model_shape
    from workbench.plan.stepclock import calibrate_step
    from workbench.plan.timing import estimate_data
    from workbench.spec.precision import local_device_kind, resolve_precision

    shape = model_shape(spec.model.id, spec.model.revision, spec.model.trust_remote_code)
    load = resolve_precision(spec.model.dtype, spec.method.kind,
                             local_device_kind() if on_gpu else "cpu").load_dtype
    seq = max(1, int(estimate_data(spec).tokens_per_example))  # as the planner times a step
    calibrate_step(target, spec, shape, seq, dtype, load, on_gpu,
                   device_key(target, on_gpu, cal.device.get("gpu_type") or ""))


def measure_here(target: str, on_gpu: bool, dtype: str, hiddens: tuple[int, ...] = (),
                 old: Calibration | None = None) -> Calibration:
    """Measure this machine (its CPU, or its first GPU) into a Calibration of ``target``,
    keeping ``old``'s layer figures (and their spreads) of other sizes when it is of this device
    and dtype. Every figure is the median of ``READINGS`` steady readings, its spread kept."""
    import socket

    matmul, layers, spread = measure(on_gpu, dtype, hiddens)
    (optimizer, spread["optimizer"]) = measure_optimizer(on_gpu)
    (load, spread["load"]), (save, spread["save"]) = measure_load(on_gpu), measure_save(on_gpu)
    ident = device_identity(on_gpu)
    if old is not None and old.device == ident and old.dtype == dtype:
        layers = {**old.layers, **layers}
        spread = {**{k: v for k, v in old.spread.items() if k.startswith("layers.")}, **spread}
    job = os.environ.get("SLURM_JOB_ID")
    where = f"Slurm job {job} on {socket.gethostname()}" if job else socket.gethostname()
    return Calibration(target=target, date=_dt.date.today().isoformat(), device=ident,
                       dtype=dtype, matmul_gflops=matmul, layers=layers,
                       optimizer_params_per_s=optimizer, where=where, load_bytes_per_s=load,
                       save_bytes_per_s=save, spread=spread, readings=READINGS)


def first_plan_here(target: str, on_gpu: bool, dtype: str, hidden: int) -> bool:
    """Measure this machine when a CPU run on it is planned and it was never measured (no
    calibration file at all: a stored one of another device or a corrupt one is left as it is):
    the first plan of a fresh home is then a calibrated one, not a table guess. A few seconds,
    once; True when it measured."""
    if target != "local" or on_gpu or calibration_file(target).exists():
        return False
    store(measure_here(target, False, dtype, (*_CPU_HIDDENS, hidden)))
    return True
