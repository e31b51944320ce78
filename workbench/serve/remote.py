"""What the SSH and Slurm serve targets share: an endpoint folder on another machine, and tunnels.

:class:`_Remote` copies what the server reads (adapters, a model folder the target lacks, the
endpoint folder's own files) next to it, reads the guard's files there, and brings the server log
back into the local endpoint folder. :func:`open_tunnel` forwards a local port to a server this
process cannot reach directly (``ssh -L``); a tunnel ends with the process that opened it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import DeployError
from workbench.serve.target import PROBE, _parse_probe

if TYPE_CHECKING:
    from workbench.runs.registry import EndpointRecord
    from workbench.serve.sources import ServePlan
    from workbench.targets.backends.remote import Transport
    from workbench.targets.named import SlurmTarget, SSHTarget


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
        from workbench.targets.named import TargetError

        tr, t = self.transport(), self.target
        try:
            prefix = t.remote_shell_prefix(tr, f"{(self.remote_parent() or '~').rstrip('/')}/.probe")
            # The guard needs workbench in the target's python; vLLM may live in another one.
            guard = tr.run(f"{prefix}{shlex.quote(t.python)} -c 'import workbench.serve'",
                           check=False, timeout=120)
            if guard.returncode != 0:
                raise DeployError(f"{t.python} on {tr.where} cannot import workbench, which runs "
                                  f"the server's guard:\n{guard.text[-800:]}\n-> fix 'python:' "
                                  f"(or 'setup:') of {t.ref}; `workbench targets check {t.ref}`")
            res = tr.run(f"{prefix}{shlex.quote(python)} -c {shlex.quote(PROBE)}",
                         check=False, timeout=120)
        except TargetError as exc:
            raise DeployError(str(exc)) from None
        return _parse_probe(res.stdout.decode(errors="replace") + res.stderr.decode(
            errors="replace"), python, tr.where)

    def gpus(self, wanted: int = 0) -> int | None:
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
        from workbench.runs.rundir import write_json_atomic

        path = workdir / "placement.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        write_json_atomic(path, {**data, **fields})

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        """Copy what the server reads into its folder on the target, unless it is already there.

        Adapters (small) are always copied. A local model folder is used in place when the same
        path holds a model on the target (a shared filesystem, or the same model cache), else
        copied; a hub id stays a hub id.
        """
        from workbench.targets.backends.remote import put_dir, shell_path

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
            from workbench.targets.backends.remote import put_dir

            put_dir(self.transport(), workdir, sdir.rsplit("/", 1)[0])

    def _remote_dir(self, record: EndpointRecord) -> str | None:
        """The endpoint folder on the target; None when the server uses the local one."""
        sdir = self._placement(record).get("server_dir", record.endpoint_dir)
        return None if sdir == record.endpoint_dir else str(sdir)

    def _read_remote(self, sdir: str, name: str, offset: int = 0) -> bytes:
        from workbench.targets.backends.remote import read_remote
        from workbench.targets.named import TargetError

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

_tunnels: dict[str, tuple[subprocess.Popen, str, str]] = {}  # endpoint dir -> (ssh, remote, url)


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
