"""Backends start a prepared run directory on a target and answer questions about it.

A backend is anything with this shape (a Protocol, not a base class to inherit from):

    submit(run_dir, spec) -> str        start the run; return the backend job id, e.g. "local:4242"
    status(run_dir, job_id) -> dict     status.json, corrected by what the backend knows about the
                                        process/job (a run whose processes vanished is "failed")
    cancel(run_dir, job_id, stop_request=None) -> None
                                        stop every process of the run; the run ends "cancelled",
                                        or "pruned" with stop_request="prune" (a sweep's request,
                                        recorded where the run's supervisor reads it before the
                                        stop is sent)
    read(run_dir, path, offset) -> bytes   bytes of a run-directory file from ``offset`` (remote
                                        backends read incrementally over SSH; local reads the file)
    logs(run_dir) -> dict[str, str]     log file name -> text

Remote backends also have ``shells(spec) -> [(transport, prefix)]``: a shell, with the target's
set-up and plain env, on each host whose files the run reads (workbench.targets.remote_model looks for a
model folder there). A backend may have ``check_resources(spec)``, which ``launch`` calls before
anything of the run is made: it raises ResourceError for a request the target can never hold (the
Slurm backend: more GPUs, CPUs or nodes than the partition's nodes have).

The run directory is the only channel between a run and its readers, so every backend looks the
same to the Job handle, the widgets, the CLI and the lab panel. ``get_backend(target)`` maps a
spec's ``target`` ("local", "ssh:NAME", "slurm:NAME") to an instance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from workbench.errors import LaunchError
from workbench.spec import RunSpec


@runtime_checkable
class Backend(Protocol):
    name: str

    def submit(self, run_dir: Path, spec: RunSpec) -> str: ...

    def status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]: ...

    def cancel(self, run_dir: Path, job_id: str | None, timeout: float = 30.0,
               stop_request: str | None = None) -> None: ...

    def read(self, run_dir: Path, path: str, offset: int = 0) -> bytes: ...

    def logs(self, run_dir: Path) -> dict[str, str]: ...


def get_backend(target: str) -> Backend:
    if target == "local":
        from workbench.targets.backends.local import LocalBackend

        return LocalBackend()
    if target.startswith("ssh:"):
        from workbench.targets.backends.ssh import SSHBackend

        return SSHBackend(target)
    if target.startswith("slurm:"):
        from workbench.targets.backends.slurm import SlurmBackend

        return SlurmBackend(target)
    kind = target.split(":", 1)[0]
    raise LaunchError(
        f"target {target!r}: the {kind} backend is not available in this version; use "
        "target: local"
    )
