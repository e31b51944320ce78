"""The local backend: torchrun on this machine (gloo on CPU, nccl on GPU), detached from the kernel.

``submit`` starts ``python -m workbench.supervise RUN_DIR`` in a new session, so restarting or
closing the notebook kernel does not stop training; any later process finds the run again through
the registry and its run directory. The job id is ``local:PID`` of the supervisor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from workbench.errors import LaunchError, ResourceError
from workbench.rundir import CANCELLED, FAILED, QUEUED, TERMINAL, RunDir
from workbench.spec import RunSpec
from workbench.targets import SSHTarget, TargetReport, probe_environment, register_check

# Popen objects of supervisors this process started, so they are reaped (no zombies) once done.
_children: dict[int, subprocess.Popen] = {}


def check_local_resources(spec: RunSpec) -> None:
    """Refuse what this machine cannot run, before anything starts."""
    want = spec.resources.gpus_per_node
    if spec.resources.nodes != 1:
        raise ResourceError(
            f"resources.nodes is {spec.resources.nodes}, but the local target is one machine; "
            "set resources.nodes: 1 or use an ssh:/slurm: target"
        )
    if want == 0 and spec.method.kind != "qlora":
        return  # a CPU run needs nothing we would have to import torch to check
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want > have:
        where = "none" if have == 0 else f"only {have}"
        raise ResourceError(
            f"resources.gpus_per_node is {want} but this machine has {where}; set "
            f"resources.gpus_per_node: {have} (0 trains on CPU) or use a target with GPUs"
        )
    if spec.method.kind == "qlora" and have == 0:
        raise ResourceError(
            "method.kind qlora needs a CUDA GPU (bitsandbytes 4-bit); on CPU use method.kind: lora"
        )


def _pid(job_id: str | None) -> int | None:
    if job_id and job_id.startswith("local:"):
        return int(job_id.split(":", 1)[1])
    return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        _children.pop(pid, None)
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalBackend:
    name = "local"

    def submit(self, run_dir: Path, spec: RunSpec) -> str:
        rd = RunDir(run_dir)
        check_local_resources(spec)
        rd.write_status(state=QUEUED, submitted=time.time())
        log = (rd.logs_dir / "supervisor.log").open("ab")
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "workbench.supervise", str(rd.path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=rd.path, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            raise LaunchError(f"could not start the supervisor: {exc}") from None
        finally:
            log.close()
        _children[child.pid] = child
        return f"local:{child.pid}"

    def status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        rd = RunDir(run_dir)
        status = rd.status()
        if status.get("state") in TERMINAL:
            return status
        if _alive(_pid(job_id)):
            return status
        # The supervisor writes the terminal state just before it exits: read again before
        # concluding it died without one.
        status = rd.status()
        if status.get("state") in TERMINAL:
            return status
        if status.get("state") == QUEUED and time.time() - status.get("submitted", 0) < 10:
            return status  # not yet started: the supervisor is still importing
        return rd.write_status(
            state=FAILED, ended=time.time(),
            error="the run's supervisor process exited without recording an outcome (killed, "
                  "or the machine restarted); see logs/supervisor.log",
        )

    def cancel(self, run_dir: Path, job_id: str | None, timeout: float = 30.0) -> None:
        rd = RunDir(run_dir)
        pid = _pid(job_id)
        if rd.status().get("state") in TERMINAL:
            return
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.time() + timeout
            while time.time() < deadline and _alive(pid):
                time.sleep(0.2)
        if _alive(pid):  # it did not stop in time: stop everything by force
            launcher = rd.status().get("launcher_pid")
            for target in (launcher, pid):
                if target:
                    try:
                        os.killpg(target, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        if rd.status().get("state") not in TERMINAL:
            rd.write_status(state=CANCELLED, ended=time.time())

    def read(self, run_dir: Path, path: str, offset: int = 0) -> bytes:
        return RunDir(run_dir).read_from(path, offset)

    def logs(self, run_dir: Path) -> dict[str, str]:
        return {p.name: p.read_text(encoding="utf-8", errors="replace")
                for p in RunDir(run_dir).log_files()}


def check_local_target(target: SSHTarget, report: TargetReport) -> None:
    """``workbench targets check local``: this machine's Python, torch, GPUs and free disk."""
    from workbench.backends.remote import LocalTransport

    probe_environment(LocalTransport(), target, target.workdir, report, "this machine")


register_check("local", check_local_target)
