"""The local backend: torchrun on this machine (gloo on CPU, nccl on GPU), detached from the kernel.

``submit`` starts ``python -m workbench.runs.supervise RUN_DIR`` in a new session, so restarting or
closing the notebook kernel does not stop training; any later process finds the run again through
the registry and its run directory. The job id is ``local:PID`` of the first supervisor, for
people; who is running is read from status.json's ``processes`` (see :mod:`workbench.runs.procs`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import LaunchError, ResourceError
from workbench.runs import procs
from workbench.runs.rundir import FAILED, QUEUED, TERMINAL, RunDir, cancelled_state
from workbench.spec import RunSpec
from workbench.targets.check import TargetReport, probe_environment, register_check
from workbench.targets.named import SSHTarget

if TYPE_CHECKING:
    from workbench.runs.standby import Standby

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
    if want:
        # The supervisor leases the cards when it starts; refusing here says so before anything
        # starts (a run that starts in between still gets a clear error from the lease).
        from workbench.targets import leases

        leases.check_free(spec.name, want)


def _reap() -> None:
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            _children.pop(pid, None)


def _supervisor_died(status: dict[str, Any]) -> None:
    """Record ``failed`` if (read under the status lock) the attempt's processes are all gone and
    no outcome was recorded: only then is it known that the attempt died."""
    if status.get("state") in TERMINAL:
        return
    idents = procs.of_attempt(status)
    if not idents or procs.elsewhere(idents) or procs.alive_here(idents):
        return
    sup = next((p for p in idents if p.role == "supervisor"), idents[0])
    status.update(
        state=FAILED, ended=time.time(), warning=None,
        error=f"the run's supervisor, {sup.describe()}, died without recording an outcome "
              "(killed, e.g. by kill -9 or the out-of-memory killer, or the machine restarted); "
              "see logs/supervisor.log; job.resume() goes on from the newest snapshot",
    )


class LocalBackend:
    """Judges a run by the processes its current attempt recorded in status.json, never by the
    job id: a handle made before a resume elsewhere still sees (and stops) the run as it is."""

    name = "local"

    def submit(self, run_dir: Path, spec: RunSpec, standby: Standby | None = None) -> str:
        """Start the run's supervisor, or give ``standby`` (started by launch, its ranks
        waiting: :mod:`workbench.runs.standby`) the run directory."""
        rd = RunDir(run_dir)
        try:
            check_local_resources(spec)
        except BaseException:
            if standby is not None:
                standby.discard()
            raise
        _reap()
        child = standby.hand_over(rd, spec) if standby is not None else None
        if child is None:
            child = self._start(rd)
        _children[child.pid] = child
        # Recorded before returning, so no reader ever sees this attempt without its supervisor
        # (an unreaped child keeps its identity even if it has exited already).
        sup = procs.ProcessIdentity.of(child.pid, "supervisor")
        procs.start_attempt(rd, sup, state=QUEUED, submitted=time.time())
        return f"local:{child.pid}"

    @staticmethod
    def _start(rd: RunDir) -> subprocess.Popen:
        log = (rd.logs_dir / "supervisor.log").open("ab")
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "workbench.runs.supervise", str(rd.path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=rd.path, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            raise LaunchError(f"could not start the supervisor: {exc}") from None
        finally:
            log.close()
        return child

    def status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        rd = RunDir(run_dir)
        _reap()
        status = rd.status()
        if status.get("state") in TERMINAL:
            return status
        idents = procs.of_attempt(status)
        if not idents:
            if status.get("supervisor_pid"):  # a bare PID may since belong to anything
                return {**status, "warning": "this run was started by a workbench version that "
                        "did not record its processes, so whether it still runs is unknown; "
                        "look at logs/supervisor.log (and stop it by hand if it still runs)"}
            return status  # nothing started yet
        away = procs.elsewhere(idents)
        if away:
            return {**status, "warning": "cannot check " + ", ".join(p.describe() for p in away)
                    + f" from {procs.hostname()}"}
        live = procs.alive_here(idents)
        if live:
            if not any(p.role == "supervisor" for p in live):
                return {**status, "warning": "the supervisor is gone; its processes are ending"}
            return status
        with rd.attempt_lock() as free:
            if not free:
                return status  # a resume is starting the next attempt right now
            return rd.update_status(_supervisor_died)

    def cancel(self, run_dir: Path, job_id: str | None, timeout: float = 30.0,
               stop_request: str | None = None) -> None:
        rd = RunDir(run_dir)
        status = rd.status()
        if status.get("state") in TERMINAL:
            return
        if stop_request:  # the supervisor reads why once its ranks have stopped
            status = rd.write_status(stop_request=stop_request)
        idents = procs.of_attempt(status)
        supervisor = [p for p in procs.alive_here(idents) if p.role == "supervisor"]
        if supervisor and supervisor[0].signal(signal.SIGTERM):
            # The supervisor stops the ranks, kills stragglers and records 'cancelled' itself.
            deadline = time.time() + timeout
            while time.time() < deadline and procs.alive_here(idents):
                time.sleep(0.2)
        left = procs.alive_here(idents)
        if left:  # no supervisor to do it, or it did not stop in time: stop them here
            procs.terminate(left, grace_s=5.0)

        def conclude(now: dict[str, Any]) -> None:
            if now.get("state") in TERMINAL or now.get("attempt") != status.get("attempt"):
                return
            still = procs.alive_here(procs.of_attempt(now))
            if still or procs.elsewhere(idents):
                now["warning"] = "cancel could not confirm that these stopped: " + ", ".join(
                    p.describe() for p in still + procs.elsewhere(idents))
                return
            now.update(state=cancelled_state(now), ended=time.time(), warning=None)

        rd.update_status(conclude)
        _reap()

    def read(self, run_dir: Path, path: str, offset: int = 0) -> bytes:
        return RunDir(run_dir).read_from(path, offset)

    def logs(self, run_dir: Path) -> dict[str, str]:
        return {p.name: p.read_text(encoding="utf-8", errors="replace")
                for p in RunDir(run_dir).log_files()}


def check_local_target(target: SSHTarget, report: TargetReport) -> None:
    """``workbench targets check local``: this machine's Python, torch, GPUs and free disk."""
    from workbench.targets.backends.remote import LocalTransport

    probe_environment(LocalTransport(), target, target.workdir, report, "this machine")


register_check("local", check_local_target)
