"""The ``local`` serve target: the guard runs as a child of this process, on this machine.

The guard starts in its own session (so stopping its process group stops vLLM with it) and is
reaped when it ends; the server is reached at the address it listens on, loopback by default.
The guard's and the server's identities (pid and start time, :mod:`workbench.runs.procs`) are kept in
the endpoint folder's ``processes.json``: liveness and stop go by them, never by a bare PID, so a
PID the kernel has since handed to another process is never signalled. The endpoint is alive while
either lives (a server whose guard was killed still answers), and a record reads them only while
the folder is still its deployment's (:mod:`workbench.serve.identity`), so a record of an earlier
endpoint of the name never reaches the processes of a newer one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.runs import procs
from workbench.runs.rundir import write_json_atomic
from workbench.serve.identity import folder_is_of
from workbench.serve.target import PROBE, _parse_probe, read_address, serving_python

if TYPE_CHECKING:
    from workbench.runs.registry import EndpointRecord
    from workbench.serve.sources import ServePlan

_children: dict[int, subprocess.Popen] = {}  # guards this process started, reaped when done
PROCESSES = "processes.json"  # the guard's and the server's identities, in the endpoint folder


def _identities(record: EndpointRecord) -> list[procs.ProcessIdentity] | None:
    """The endpoint's recorded processes; None when its folder keeps no readable record of them,
    none at all once the folder holds a newer deployment of the name."""
    if not folder_is_of(record):
        return []
    try:
        data = json.loads((Path(record.endpoint_dir) / PROCESSES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return [procs.ProcessIdentity.from_dict(d) for d in data]


class LocalServeTarget:
    ref = "local"
    default_host = "127.0.0.1"
    guard_python = sys.executable

    def python(self, explicit: str | None, spec_python: str | None) -> str:
        return serving_python(explicit, spec_python)

    def probe(self, python: str) -> dict[str, Any]:
        try:
            out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                                 timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            return _parse_probe(str(exc), python, "this machine")
        return _parse_probe(out.stdout + out.stderr, python, "this machine")

    def gpus(self, wanted: int = 0) -> int | None:
        return None

    def server_dir(self, workdir: Path) -> str:
        return str(workdir)

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        return plan

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int, gpus: int = 0) -> tuple[int, int]:
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("VIRTUAL_ENV", "PYTHONHOME", "VLLM_API_KEY")}
        full_env.update(env)
        with (workdir / "server.log").open("ab") as fh:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=fh,
                                     stderr=subprocess.STDOUT, cwd=workdir, env=full_env,
                                     start_new_session=True)
        _children[child.pid] = child
        pid_file = workdir / "server.pid"
        deadline = time.time() + 30
        while not pid_file.is_file() and child.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        server_pid = int(pid_file.read_text()) if pid_file.is_file() else 0
        idents = [procs.ProcessIdentity.of(child.pid, "guard")]
        if server_pid:
            try:
                idents.append(procs.ProcessIdentity.of(server_pid, "server"))
            except procs.psutil.NoSuchProcess:
                pass  # it already died: the guard records how in exit.json
        write_json_atomic(workdir / PROCESSES, [i.to_dict() for i in idents])
        return child.pid, server_pid

    def alive(self, record: EndpointRecord) -> bool:
        import psutil

        pid = record.pid or 0
        child = _children.get(pid)
        if child is not None and child.poll() is not None:
            _children.pop(pid, None)  # the guard has ended and is reaped; the server may live on
        idents = _identities(record)
        if idents is not None:
            return any(i.alive() for i in idents)
        if child is not None and child.returncode is not None:
            return False
        try:
            proc = psutil.Process(pid)
            # A recycled pid is someone else's process: the guard names its endpoint folder.
            return proc.status() != psutil.STATUS_ZOMBIE and record.endpoint_dir in proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def note(self, record: EndpointRecord) -> str:
        return ""

    def read(self, record: EndpointRecord, name: str) -> bytes:
        try:
            return (Path(record.endpoint_dir) / name).read_bytes()
        except OSError:
            return b""

    def sync_log(self, record: EndpointRecord) -> None:
        return None  # the log is written here

    def address(self, record: EndpointRecord) -> str | None:
        return read_address(self.read(record, "address.json"), "127.0.0.1")

    def connect(self, record: EndpointRecord) -> str:
        return self.address(record) or record.url

    def stop(self, record: EndpointRecord, timeout: float = 20.0) -> None:
        import psutil

        idents = _identities(record)
        if idents is not None:  # the guard first (it stops vLLM and records exit.json)
            procs.terminate([i for i in idents if i.role == "guard"], grace_s=timeout)
            procs.terminate([i for i in idents if i.role != "guard"], grace_s=5.0)
            child = _children.pop(record.pid or 0, None)
            if child is not None:
                child.poll()  # reap it
            return
        pid, alive_procs = record.pid or 0, []
        for p in (pid, record.server_pid):
            if p:
                try:
                    alive_procs.append(psutil.Process(p))
                except psutil.NoSuchProcess:
                    pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in alive_procs:
                try:
                    os.killpg(proc.pid, sig) if proc.pid == pid else proc.send_signal(sig)
                except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                    pass
            child = _children.get(pid)
            if child is not None:
                try:
                    child.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            _, alive_procs = psutil.wait_procs(alive_procs,
                                               timeout=timeout if sig == signal.SIGTERM else 5)
            if not alive_procs:
                break
        _children.pop(pid, None)

