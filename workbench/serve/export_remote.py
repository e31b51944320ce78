"""Export where the weights are: a run on an SSH host or a Slurm cluster is exported there, and only
the folders asked for come back into the local run directory (its mirror) or ``out``.

As ``job.evaluate`` does (workbench/evaluate/remote.py): an SSH run runs ``python -m
workbench.serve.export_host RUN_DIR`` on its first host, where rank 0 wrote the weights, through
the backend's transport with the target's environment and secrets, reading the request (formats,
types, dtype) as JSON on stdin; a Slurm run runs the same command under ``srun`` in a job of its
own on the run's partition (:func:`workbench.targets.backends.slurm_script.eval_srun_command`'s
allocation). The host refuses what cannot work there before any work (no llama.cpp tools on the
host, too little disk there) and writes into its RUN_DIR/export; each folder then comes back as
one tar stream (:func:`workbench.targets.backends.remote.get_dir`) into a temporary folder here,
moved into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.errors import ExportError
from workbench.serve.export_source import RunSource

# How long an export on the target may take (a 70B merge and several quantisations included).
TIMEOUT_S = 6 * 3600.0
ANSWER = "WORKBENCH-EXPORT "


def export_on_target(src: RunSource, request: dict[str, Any], root: Path,
                     say: Callable[[str], None], limit: float | None = None) -> dict[str, Any]:
    """Run the export on ``src``'s target and bring its folders back into ``root``; the host's
    answer with ``folders`` naming the local copies."""
    from workbench.targets.backends.remote import get_dir, load_placement
    from workbench.targets.backends.slurm import SlurmBackend

    backend = src.handle.backend
    placement = load_placement(src.run_dir)
    timeout = min(TIMEOUT_S, limit) if limit else TIMEOUT_S
    if isinstance(backend, SlurmBackend):
        transport, remote_dir, command, cleanup = _slurm_command(src, backend, placement)
    else:
        transport, remote_dir, command, cleanup = _ssh_command(src, backend, placement)
    if remote_dir is None:  # a Slurm run kept in place here: the job writes into ``root`` itself
        request = {**request, "out": str(root)}
    via = "" if src.remote == transport.where else f" through {transport.where}"
    say(f"exporting on {src.remote}{via} in {remote_dir or src.run_dir}/export")
    try:
        res = transport.run(command, input=json.dumps(request).encode(), check=False,
                            timeout=timeout)
    finally:
        cleanup()
    text = res.stdout.decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("[export"):
            say(f"{transport.where}: {line}")
    answer = next((json.loads(ln[len(ANSWER):]) for ln in text.splitlines()
                   if ln.startswith(ANSWER)), None)
    if answer is None:
        raise ExportError(f"the export on {transport.where} ended without an answer (exit "
                          f"{res.returncode}):\n{res.text[-1500:]}\n-> check the target's "
                          "environment (`workbench targets check`)")
    if "error" in answer:
        raise ExportError(f"on {transport.where} (where the run's weights are): "
                          f"{answer['error']}")
    if remote_dir is None:  # the run directory is this one (Slurm, kept in place): nothing to copy
        return dict(answer)
    root.mkdir(parents=True, exist_ok=True)
    incoming = root / f".fetch-{os.getpid()}-{int(time.time())}"
    folders = {}
    try:
        for name, there in answer["folders"].items():
            say(f"bringing {name}/ back from {transport.where}")
            get_dir(transport, there, incoming)
        for name in answer["folders"]:
            final, old = root / name, root / f".old-{name}-{os.getpid()}"
            if final.exists():
                final.rename(old)
            (incoming / name).rename(final)
            shutil.rmtree(old, ignore_errors=True)
            folders[name] = str(final)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    return {**answer, "folders": folders}


def _ssh_command(src: RunSource, backend: Any,
                 placement: dict[str, Any]) -> tuple[Any, str, str, Callable[[], None]]:
    from workbench.targets.backends.remote import on_first_host

    if not placement.get("nodes"):
        raise ExportError(f"run {src.run_id} has no record of the host it ran on (remote.json); "
                          "export it where its weights are: `workbench export RUN` there")
    node0 = placement["nodes"][0]
    transport, command = on_first_host(backend.target, node0, "workbench.serve.export_host")
    return transport, node0["dir"], command, lambda: None


def _slurm_command(src: RunSource, backend: Any, placement: dict[str, Any],
                   ) -> tuple[Any, str | None, str, Callable[[], None]]:
    from workbench.targets.backends.slurm_script import eval_srun_command
    from workbench.targets.secrets import env_file_path, remote_quote, split_env

    target, transport = backend.target, backend.transport
    cluster_dir = placement.get("dir")
    where = cluster_dir or str(src.run_dir.resolve())
    spec_gpus = src.handle.spec.resources.gpus_per_node if hasattr(src.handle, "spec") else 0
    # The evaluation's allocation (partition, GPUs, memory, time, account), running this module.
    command = target.remote_shell_prefix(transport, where) + eval_srun_command(
        target, spec_gpus, where, f"wb-export-{src.run_dir.name}",
        module="workbench.serve.export_host")

    def cleanup() -> None:
        if split_env(target.env)[1]:  # the secrets file the login shell read: gone once read
            transport.run(f"rm -f {remote_quote(env_file_path(where))}", check=False, timeout=60)

    return transport, cluster_dir, command, cleanup
