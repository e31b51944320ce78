"""The GPU table: memory, bf16 dense peak TFLOP/s, assumed utilisation and price per card-hour.

The planner (:mod:`workbench.plan`) sizes runs against this table and budgeting prices them with
it. Defaults cover common cards; a user edits them, or adds cards, in ``$WORKBENCH_HOME/gpus.yaml``
(one mapping per card; only the fields to change)::

    RTX 4090: {price_per_hour: 1.5}
    MyCloud-L20: {memory_gib: 45, bf16_tflops: 119.5, price_per_hour: 2.6, currency: CNY}

    >>> get_gpu("a100-80g").memory_gib
    80.0

``edit_gpu("RTX 4090", price_per_hour=1.5)`` writes that file for you. The ``CPU`` pseudo-entry
describes a host used for CPU training: its memory is this machine's RAM, its TFLOP/s are *per
core*, and it is priced per core-hour by ``RunSpec.budget.price_per_cpu_core_hour``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workbench.errors import WorkbenchError

DEFAULT_CURRENCY = "CNY"


class UnknownGPUError(WorkbenchError, KeyError):
    """A GPU type is not in the table (defaults + ``$WORKBENCH_HOME/gpus.yaml``)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class GPUTableError(WorkbenchError, ValueError):
    """``$WORKBENCH_HOME/gpus.yaml`` cannot be used (bad YAML, unknown field, missing value)."""


@dataclass(frozen=True)
class GpuType:
    """One card (or the CPU pseudo-entry).

    ``utilisation`` is the assumed model-FLOPs utilisation of a fine-tuning run (fraction of
    ``bf16_tflops`` actually achieved); ``price_per_hour`` is per card-hour (per core-hour for the
    CPU entry, where ``None`` means "use the spec's price").
    """

    name: str
    memory_gib: float
    bf16_tflops: float
    price_per_hour: float | None = None
    currency: str = DEFAULT_CURRENCY
    utilisation: float = 0.35
    # Effective all-reduce bus bandwidth between cards of one node (GB/s): NVLink vs PCIe.
    interconnect_gbps: float = 20.0
    notes: str = ""
    # Memory bandwidth (GB/s, datasheet): what memory-bound work runs at (QLoRA's dequantisation).
    memory_gbps: float = 1000.0
    # False for cards before compute capability 8.0 (V100, T4): they train with fp16 autocast.
    bf16: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Memory: what torch.cuda reports as total memory, in GiB (e.g. A100 80GB: 81920 MiB).
# TFLOP/s: NVIDIA datasheets, dense bf16 tensor throughput with fp32 accumulation (the mode torch
# uses), no 2:4 sparsity. Cards without bf16 (V100, T4) list fp16 and train in fp16.
# Prices: per card-hour list prices of a small GPU cloud in CNY; None where we have no
# list price: set RunSpec.budget.price_per_gpu_hour or add one in gpus.yaml.
# Memory bandwidth: datasheets (GB/s).
# Utilisation: the fraction of the bf16 peak a fine-tuning step achieves, counting the FLOPs the
# planner counts (recomputation included). Where published measurements of these cards exist it
# is set from them (docs/planning.md, "Published reference runs"): RTX 4090 from torchtune's
# Llama-3.1-8B LoRA and QLoRA rows (3,083 and 2,413 tokens/s, compile on: 0.87 and 0.72
# implied), RTX A6000 from its 8B LoRA row (4,699 tokens/s without checkpointing: 0.95
# implied), A100 from its Llama-3.1-70B LoRA row on 8 cards (3,497 tokens/s: 0.67 implied);
# each is set below the implied figure (torchtune compiles its model, this trainer does not)
# and within the factor 1.5 that tests/test_plan_published.py holds. The other cards keep
# 35-40%, typical of tuned transformer fine-tuning on datacenter cards (unmeasured here).
_DEFAULTS: tuple[GpuType, ...] = (
    GpuType("H200", 140.0, 989.0, None, utilisation=0.40, interconnect_gbps=300.0,
            notes="SXM; 141 GB HBM3e", memory_gbps=4800.0),
    GpuType("H100", 79.6, 989.0, 9.9, utilisation=0.40, interconnect_gbps=300.0,
            notes="SXM 80 GB; PCIe variant: 756 TFLOP/s", memory_gbps=3350.0),
    GpuType("A100-80G", 80.0, 312.0, 3.75, utilisation=0.50, interconnect_gbps=200.0,
            notes="utilisation from torchtune's 70B LoRA on 8 cards", memory_gbps=2039.0),
    GpuType("A100-40G", 40.0, 312.0, 3.6, utilisation=0.50, interconnect_gbps=200.0,
            notes="utilisation as the A100-80G", memory_gbps=1555.0),
    GpuType("L40S", 45.0, 362.0, None, utilisation=0.35, interconnect_gbps=20.0,
            memory_gbps=864.0),
    GpuType("RTX A6000", 48.0, 154.8, None, utilisation=0.70, interconnect_gbps=12.0,
            notes="utilisation from torchtune's 8B LoRA on this card", memory_gbps=768.0),
    GpuType("A10G", 22.5, 70.0, None, utilisation=0.35, interconnect_gbps=12.0,
            notes="AWS g5", memory_gbps=600.0),
    GpuType("RTX 4090", 24.0, 165.2, 1.2, utilisation=0.65, interconnect_gbps=12.0,
            notes="no NVLink; P2P over PCIe is disabled; utilisation from torchtune's 8B LoRA "
            "and QLoRA on this card", memory_gbps=1008.0),
    GpuType("RTX 3090", 24.0, 71.0, None, utilisation=0.35, interconnect_gbps=12.0,
            memory_gbps=936.0),
    GpuType("V100", 32.0, 125.0, None, utilisation=0.30, interconnect_gbps=100.0,
            notes="32 GB SXM2; no bf16: fp16 figure", bf16=False, memory_gbps=900.0),
    GpuType("T4", 15.0, 65.0, None, utilisation=0.25, interconnect_gbps=8.0,
            notes="no bf16: fp16 figure", bf16=False, memory_gbps=320.0),
    # Per core: AVX2 does 2 FMA x 8 fp32 lanes x 2 FLOP per cycle, ~3 GHz -> ~0.1 TFLOP/s peak;
    # small-matrix training gets a small fraction of it.
    GpuType("CPU", 0.0, 0.1, None, utilisation=0.10, interconnect_gbps=5.0,
            notes="pseudo-entry: memory is host RAM, TFLOP/s per core, price per core-hour",
            memory_gbps=20.0),
)

_FIELDS = {f.name for f in dataclasses.fields(GpuType)} - {"name"}


def _key(name: str) -> str:
    # "A100_80G", "a100-80g" and "A100 80G" are the same card to a user.
    return re.sub(r"[\s_\-]+", "", name).lower()


def overrides_path() -> Path:
    from workbench.runs.home import home

    return home() / "gpus.yaml"


def _read_overrides(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise GPUTableError(f"{path} is not valid YAML: {exc}; fix or delete it") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise GPUTableError(
            f"{path} must map card names to fields, e.g. 'RTX 4090: {{price_per_hour: 1.5}}'"
        )
    for name, fields in data.items():
        unknown = set(fields) - _FIELDS
        if unknown:
            raise GPUTableError(
                f"{path}: card {name!r} has unknown field(s) {sorted(unknown)}; "
                f"allowed: {sorted(_FIELDS)}"
            )
    return {str(k): v for k, v in data.items()}


def gpu_table(path: Path | None = None) -> dict[str, GpuType]:
    """Defaults merged with the user's overrides, keyed by display name."""
    table = {g.name: g for g in _DEFAULTS}
    by_key = {_key(n): n for n in table}
    for name, fields in _read_overrides(path or overrides_path()).items():
        existing = by_key.get(_key(name))
        if existing is not None:
            table[existing] = dataclasses.replace(table[existing], **fields)
            continue
        missing = {"memory_gib", "bf16_tflops"} - set(fields)
        if missing:
            raise GPUTableError(
                f"new card {name!r} in {path or overrides_path()} needs {sorted(missing)}"
            )
        table[name] = GpuType(name=name, **fields)
        by_key[_key(name)] = name
    if "CPU" in table and table["CPU"].memory_gib == 0.0:
        import psutil

        table["CPU"] = dataclasses.replace(
            table["CPU"], memory_gib=psutil.virtual_memory().total / 2**30
        )
    return table


def get_gpu(name: str, table: dict[str, GpuType] | None = None) -> GpuType:
    """The card called ``name`` (case, spaces, '-' and '_' ignored), or UnknownGPUError."""
    table = table if table is not None else gpu_table()
    for display, gpu in table.items():
        if _key(display) == _key(name):
            return gpu
    raise UnknownGPUError(
        f"unknown GPU type {name!r}; known types: {', '.join(table)}. Fix resources.gpu_type, "
        f"or add the card (memory_gib, bf16_tflops, price_per_hour) to {overrides_path()}"
    )


def edit_gpu(name: str, **fields: Any) -> GpuType:
    """Change (or add) a card in ``$WORKBENCH_HOME/gpus.yaml`` and return the merged entry.

    >>> edit_gpu("RTX 4090", price_per_hour=1.5).price_per_hour  # doctest: +SKIP
    1.5
    """
    unknown = set(fields) - _FIELDS
    if unknown:
        raise GPUTableError(f"unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}")
    path = overrides_path()
    data = _read_overrides(path)
    existing = next((n for n in data if _key(n) == _key(name)), None)
    default = next((g.name for g in _DEFAULTS if _key(g.name) == _key(name)), None)
    entry_name = existing or default or name
    data.setdefault(entry_name, {}).update(fields)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return get_gpu(entry_name)


def detect_gpu_type() -> str | None:
    """The table name of this machine's first CUDA card, or None without one (or if unknown)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0)
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    except Exception:  # a broken driver must not break planning
        return None
    return gpu_type_from_device_name(name, memory_gib)


def gpu_type_from_device_name(device_name: str, memory_gib: float) -> str | None:
    """Map a torch.cuda device name (e.g. 'NVIDIA A100-SXM4-80GB') to a table name."""
    n = device_name.upper()
    if "A100" in n:
        # The 40 GB and 80 GB A100 share a name prefix; memory tells them apart.
        return "A100-80G" if memory_gib > 50 else "A100-40G"
    for needle, table_name in (("A6000", "RTX A6000"), ("H200", "H200"), ("H100", "H100"), ("L40S", "L40S"),
                               ("A10G", "A10G"), ("4090", "RTX 4090"), ("3090", "RTX 3090"),
                               ("V100", "V100"), ("T4", "T4")):
        if needle in n:
            return table_name
    return None
