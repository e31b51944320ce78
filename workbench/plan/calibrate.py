"""Calibration: what a target really achieves for training-shaped work, measured and stored.

:func:`calibrate` times, with torch at the run's dtype, a square matrix product and a forward and
backward pass of a transformer MLP block (``hidden -> 4 hidden -> hidden``, SiLU) at a few hidden
sizes (and the model's own, given a spec), and writes ``WORKBENCH_HOME/calibration/TARGET.json``
with the date and the device it ran on (CPU model and core count, or GPU name). ``workbench
targets check local`` runs it; a remote target is measured on the target itself by
:mod:`workbench.plan.probe` (the same measurement, run there). :func:`load_calibration` gives the
planner the stored figures only for the device being planned: a calibration from another device
is not used, and a file that cannot be read is reported (``CalibrationWarning``) and ignored, so
the planner falls back to the GPU table's peak times its stated utilisation.

    >>> calibrate("local").train_gflops(64)  # doctest: +SKIP
    3.1
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Re-exported: callers import these names from here.
from workbench.plan.calstore import (  # noqa: F401
    CalibrationError,
    CalibrationWarning,
    calibration_dir,
    calibration_file,
)

VERSION = 1
_CPU_HIDDENS = (64, 256, 1024)  # tiny model, small, 0.5B-class (Qwen2.5-0.5B: 896)
_GPU_HIDDENS = (1024, 4096)
_MEASURE_S = 0.3  # per measurement, after one warm-up call


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

    def train_gflops(self, hidden: int) -> tuple[float, int]:
        """(GFLOP/s of a forward+backward at the measured hidden size nearest ``hidden``, that
        size)."""
        if not self.layers:
            raise CalibrationError("this calibration has no layer measurement")
        h = min((int(k) for k in self.layers), key=lambda k: abs(k - hidden) / max(k, hidden))
        return self.layers[str(h)], h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _time(fn: Any, sync: Any) -> float:
    """Seconds per call of fn: one warm-up, then as many calls as fit in _MEASURE_S."""
    fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= _MEASURE_S:
            return elapsed / n


def measure(on_gpu: bool, dtype: str = "float32", hiddens: tuple[int, ...] = (),
            tokens: int | None = None) -> tuple[float, dict[str, float]]:
    """(matmul GFLOP/s, {hidden: forward+backward GFLOP/s}) on this machine's CPU or first GPU."""
    try:
        import torch
    except ImportError as exc:
        raise CalibrationError(f"torch is not importable here ({exc}): install it to calibrate"
                               ) from exc
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise CalibrationError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    dev = torch.device("cuda" if on_gpu else "cpu")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    n = 4096 if on_gpu else 512
    a = torch.randn(n, n, device=dev, dtype=tdtype)
    b = torch.randn(n, n, device=dev, dtype=tdtype)
    matmul = 2 * n**3 / _time(lambda: a @ b, sync) / 1e9
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
        layers[str(h)] = flops / _time(step, sync) / 1e9
    return matmul, layers


def measure_optimizer(on_gpu: bool) -> float:
    """Parameters per second through what the Trainer does after backward on every step:
    clip the gradient norm, AdamW's step (fp32 weights, gradients and two moments) and
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

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    return n / _time(step, sync)


def measure_load(on_gpu: bool) -> float:
    """Bytes per second of float32 weights made ready on the device from a bfloat16 safetensors
    file in the page cache, into new memory each time: what ``from_pretrained`` spends its load
    on (reading, converting, the new pages' faults); not the disk (a first read of a cold file
    is workbench.runs.startup's disk rate)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    n = 32 * 2**20  # 64 MB on disk, 128 MB made: past the caches, quick
    dev = "cuda" if on_gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "w.safetensors")
        save_file({"w": torch.ones(n, dtype=torch.bfloat16)}, path)

        def load() -> None:
            load_file(path, device=dev)["w"].float()

        def sync() -> None:
            if on_gpu:
                torch.cuda.synchronize()

        return 4 * n / _time(load, sync)


def measure_save(on_gpu: bool) -> float:
    """Bytes per second of float32 weights on the device written to a safetensors file (into the
    page cache, as a run's last save lands): what ``save_model`` spends the finish on."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    n = 16 * 2**20  # 64 MB, past the caches, quick
    w = torch.ones(n, dtype=torch.float32, device="cuda" if on_gpu else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "w.safetensors")
        return 4 * n / _time(lambda: save_file({"w": w}, path), lambda: None)


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


def device_key(target: str, on_gpu: bool, gpu_name: str) -> str:
    """The key the planner groups runs and step measurements of ``target``'s device by."""
    if on_gpu:
        return gpu_name
    if target == "local":
        ident = device_identity(False)
        return f"{ident['name']} x{ident['cores']}"
    return "CPU"  # a remote CPU target: only a measurement made there describes it


def measure_here(target: str, on_gpu: bool, dtype: str, hiddens: tuple[int, ...] = (),
                 old: Calibration | None = None) -> Calibration:
    """Measure this machine (its CPU, or its first GPU) into a Calibration of ``target``,
    keeping ``old``'s layer figures of other sizes when it is of this device and dtype."""
    import socket

    matmul, layers = measure(on_gpu, dtype, hiddens)
    optimizer = measure_optimizer(on_gpu)
    load, save = measure_load(on_gpu), measure_save(on_gpu)
    ident = device_identity(on_gpu)
    if old is not None and old.device == ident and old.dtype == dtype:
        layers = {**old.layers, **layers}
    job = os.environ.get("SLURM_JOB_ID")
    where = f"Slurm job {job} on {socket.gethostname()}" if job else socket.gethostname()
    return Calibration(target=target, date=_dt.date.today().isoformat(), device=ident,
                       dtype=dtype, matmul_gflops=matmul, layers=layers,
                       optimizer_params_per_s=optimizer, where=where, load_bytes_per_s=load,
                       save_bytes_per_s=save)


def first_plan_here(target: str, on_gpu: bool, dtype: str, hidden: int) -> bool:
    """Measure this machine when a CPU run on it is planned and it was never measured (no
    calibration file at all: a stored one of another device or a corrupt one is left as it is):
    the first plan of a fresh home is then a calibrated one, not a table guess. A few seconds,
    once; True when it measured."""
    if target != "local" or on_gpu or calibration_file(target).exists():
        return False
    store(measure_here(target, False, dtype, (*_CPU_HIDDENS, hidden)))
    return True


def store(cal: Calibration) -> Path:
    """Write ``cal`` as its target's calibration (atomically: a reader never sees half)."""
    path = calibration_file(cal.target)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)
    return path


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
        raw = json.loads(path.read_text())
        cal = Calibration(**raw)
        if not isinstance(cal.device, dict) or not isinstance(cal.layers, dict):
            raise TypeError("device and layers must be mappings")
        if cal.source not in ("local measured", "target probe") or not isinstance(cal.where,
                                                                                   str):
            raise ValueError(f"unknown source {cal.source!r}")
        cal.matmul_gflops = float(cal.matmul_gflops)
        cal.layers = {str(int(k)): float(v) for k, v in cal.layers.items()}
        rates = ("optimizer_params_per_s", "load_bytes_per_s", "save_bytes_per_s")
        for rate in rates:
            if getattr(cal, rate) is not None:
                setattr(cal, rate, float(getattr(cal, rate)))
        if cal.matmul_gflops <= 0 or any(v <= 0 for v in cal.layers.values()) or any(
                v is not None and v <= 0 for v in (getattr(cal, r) for r in rates)):
            raise ValueError("throughputs must be positive")
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


def time_basis(target: str, gpu: Any, on_gpu: bool, dtype: str, hidden: int,
               cores: int | None = None) -> TimeBasis:
    """The target's calibration when it was measured on this device at this dtype, else the GPU
    table's peak at its stated utilisation. ``cores``: the CPU cores per node the planner counts
    (its ``n_devices``), so a remote CPU node measured with another core count keeps its
    measured throughput per node."""
    import dataclasses

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
                           f"{'GPUs' if on_gpu else 'cores'})"), key, cal.optimizer_params_per_s,
                     {"source": cal.source, "date": cal.date, "where": cal.where or None},
                     cal.load_bytes_per_s, cal.save_bytes_per_s)


PROBE_TAG = "WORKBENCH-CALIBRATION "  # the line the probe's remote side prints its figures on
