"""Timing this machine: steady readings, and what a calibration measures with them.

This module owns the measuring itself, on the CPU or first GPU it runs on, and nothing stored:
:func:`steady` (a short warm-up, then several timed readings of which a steady figure is kept
and how far they spread is said), the device identity a calibration is keyed by
(:func:`device_identity`), and the measurements (:func:`measure`: a square matrix product and
the forward+backward of a transformer MLP block; :func:`measure_optimizer`; :func:`measure_load`;
:func:`measure_save`). Each returns its figures with their spreads (relative: ``0.05`` is
readings within ±5 % of the figure kept). :mod:`workbench.plan.calibrate` puts them together into
a stored calibration.

    >>> r = steady(lambda: None, lambda: None)
    >>> r.readings >= READINGS
    True
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.plan.calstore import CalibrationError

_CPU_HIDDENS = (64, 256, 1024)  # tiny model, small, 0.5B-class (Qwen2.5-0.5B: 896)
_GPU_HIDDENS = (1024, 4096)
WARMUP_S = 0.05  # calls before the readings (at least one): caches, thread pools, lazy set-up
READING_S = 0.08  # one reading: as many calls as fit in this (at least one)
READINGS = 3  # readings kept per figure: their median is the figure
MORE_READINGS = 2  # taken too when the first READINGS disagree by more than UNSTEADY
# Readings spread wider than this (±, relative to the figure) make a clock "unsteady": the plan
# and `targets check` say so rather than plan from it in silence.
UNSTEADY = 0.25


@dataclass(frozen=True)
class Reading:
    """Seconds per call kept from several readings, how far the kept readings spread (half their
    range over the median: 0.05 is ±5 %), and how many readings were taken."""

    seconds: float
    spread: float
    readings: int


def spread_of(values: list[float]) -> float:
    """Half the range of ``values`` over their median: ``[0.9, 1.0, 1.1]`` -> 0.1 (±10 %)."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / 2 / mid if mid > 0 else 0.0


def steady(fn: Callable[[], Any], sync: Callable[[], Any],
           clock: Callable[[], float] = time.perf_counter) -> Reading:
    """Time ``fn`` (``sync`` after each call waits for the device): a warm-up of ``WARMUP_S``,
    then ``READINGS`` readings of ``READING_S`` each. When they disagree by more than
    ``UNSTEADY`` (a first reading still warming, a neighbour's burst), ``MORE_READINGS`` more
    are taken and the steadiest ``READINGS`` in a row are kept. The figure is the median of the
    kept readings; their spread is said, however wide, never hidden. ``clock``: seconds, for a
    test to drive."""

    def reading(window: float) -> float:
        n, t0 = 0, clock()
        while True:
            fn()
            n += 1
            sync()
            elapsed = clock() - t0
            if elapsed >= window:
                return elapsed / n

    reading(WARMUP_S)
    taken = [reading(READING_S) for _ in range(READINGS)]
    if spread_of(taken) > UNSTEADY:
        taken += [reading(READING_S) for _ in range(MORE_READINGS)]
    kept = min((taken[i:i + READINGS] for i in range(len(taken) - READINGS + 1)), key=spread_of)
    return Reading(statistics.median(kept), spread_of(kept), len(taken))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity(on_gpu: bool) -> dict[str, Any]:
    """What a calibration was measured on: {"kind", "name", "cores"} (and the table's GPU type).

    Two machines with the same identity are taken to train at the same speed."""
    if not on_gpu:
        return {"kind": "cpu", "name": _cpu_model(), "cores": os.cpu_count() or 1}
    import torch

    from workbench.targets.gpus import gpu_type_from_device_name

    name = torch.cuda.get_device_name(0)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    return {"kind": "gpu", "name": name, "cores": torch.cuda.device_count(),
            "gpu_type": gpu_type_from_device_name(name, mem)}


def _sync(on_gpu: bool) -> Callable[[], None]:
    def sync() -> None:
        if on_gpu:
            import torch

            torch.cuda.synchronize()

    return sync


def measure(on_gpu: bool, dtype: str = "float32", hiddens: tuple[int, ...] = (),
            tokens: int | None = None) -> tuple[float, dict[str, float], dict[str, float]]:
    """(matmul GFLOP/s, {hidden: forward+backward GFLOP/s}, spreads) on this machine's CPU or
    first GPU; spreads are keyed ``matmul`` and ``layers.HIDDEN``."""
    try:
        import torch
    except ImportError as exc:
        raise CalibrationError(f"torch is not importable here ({exc}): install it to calibrate"
                               ) from exc
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise CalibrationError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    dev = torch.device("cuda" if on_gpu else "cpu")
    sync = _sync(on_gpu)
    n = 4096 if on_gpu else 512
    a = torch.randn(n, n, device=dev, dtype=tdtype)
    b = torch.randn(n, n, device=dev, dtype=tdtype)
    r = steady(lambda: a @ b, sync)
    matmul, spreads = 2 * n**3 / r.seconds / 1e9, {"matmul": r.spread}
    ntok = tokens or (8192 if on_gpu else 512)
    layers: dict[str, float] = {}
    for h in sorted(set(hiddens or (_GPU_HIDDENS if on_gpu else _CPU_HIDDENS))):
        up = torch.nn.Linear(h, 4 * h, bias=False, device=dev, dtype=tdtype)
        down = torch.nn.Linear(4 * h, h, bias=False, device=dev, dtype=tdtype)
        x = torch.randn(ntok, h, device=dev, dtype=tdtype, requires_grad=True)

        def step(up: Any = up, down: Any = down, x: Any = x) -> None:
            down(torch.nn.functional.silu(up(x))).sum().backward()

        # forward 2 FLOPs per multiply-add of both products; backward twice that.
        flops = 3 * 2 * ntok * (2 * 4 * h * h)
        r = steady(step, sync)
        layers[str(h)], spreads[f"layers.{h}"] = flops / r.seconds / 1e9, r.spread
    return matmul, layers, spreads


def measure_optimizer(on_gpu: bool) -> tuple[float, float]:
    """(parameters per second, spread) through what the Trainer does after backward on every
    step: clip the gradient norm, AdamW's step (fp32 weights, gradients and two moments) and
    zero_grad, on one flat parameter large enough to leave the caches."""
    import torch

    dev = torch.device("cuda" if on_gpu else "cpu")
    n = 64 * 2**20 if on_gpu else 8 * 2**20
    w = torch.nn.Parameter(torch.randn(n, device=dev))
    opt = torch.optim.AdamW([w], lr=1e-4)

    def step() -> None:
        w.grad = torch.ones_like(w)  # the backward's gradient: written every step
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _rate(n, steady(step, _sync(on_gpu)))


def measure_load(on_gpu: bool) -> tuple[float, float]:
    """(bytes per second, spread) of float32 weights made ready on the device from a bfloat16
    safetensors file in the page cache, into new memory each time: what ``from_pretrained``
    spends its load on (reading, converting, the new pages' faults); not the disk (a first read
    of a cold file is workbench.runs.startup's disk rate)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    n = 32 * 2**20  # 64 MB on disk, 128 MB made: past the caches, quick
    dev = "cuda" if on_gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "w.safetensors")
        save_file({"w": torch.ones(n, dtype=torch.bfloat16)}, path)
        return _rate(4 * n, steady(lambda: load_file(path, device=dev)["w"].float(),
                                   _sync(on_gpu)))


def measure_save(on_gpu: bool) -> tuple[float, float]:
    """(bytes per second, spread) of float32 weights on the device written to a safetensors
    file (into the page cache, as a run's last save lands): what ``save_model`` spends the
    finish on."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    n = 16 * 2**20  # 64 MB, past the caches, quick
    w = torch.ones(n, dtype=torch.float32, device="cuda" if on_gpu else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "w.safetensors")
        return _rate(4 * n, steady(lambda: save_file({"w": w}, path), lambda: None))


def _rate(work: float, r: Reading) -> tuple[float, float]:
    """(``work`` per second, spread) from a reading of seconds per call."""
    return work / r.seconds, r.spread
