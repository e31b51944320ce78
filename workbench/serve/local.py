"""The ``local`` serve target: the guard runs as a child of this process, on this machine.

The guard starts in its own session (so stopping its process group stops vLLM with it) and is
reaped when it ends; the server is reached at the address it listens on, loopback by default.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.serve.target import PROBE, _parse_probe, read_address, serving_python

if TYPE_CHECKING:
    from workbench.registry import EndpointRecord
    from workbench.serve.sources import ServePlan

_children: dict[int, subprocess.Popen] = {}  # guards this process started, reaped when done


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

    def gpus(self) -> int | None:
        return None

    def server_dir(self, workdir: Path) -> str:
        return str(workdir)

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        return plan

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int) -> tuple[int, int]:
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
        return child.pid, server_pid

    def alive(self, record: EndpointRecord) -> bool:
        import psutil

        pid = record.pid or 0
        child = _children.get(pid)
        if child is not None and child.poll() is not None:
            _children.pop(pid, None)
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

        pid, procs = record.pid or 0, []
        for p in (pid, record.server_pid):
            if p:
                try:
                    procs.append(psutil.Process(p))
                except psutil.NoSuchProcess:
                    pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
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
            _, procs = psutil.wait_procs(procs, timeout=timeout if sig == signal.SIGTERM else 5)
            if not procs:
                break
        _children.pop(pid, None)

