"""The five ZMQ ports of a remote kernel, forwarded to this machine's loopback over one SSH connection.

One ``ssh -N -M`` process per kernel, run by the same OpenSSH client and options as the backends
(:class:`~workbench.targets.backends.remote.SSHTransport`: ~/.ssh/config aliases, ProxyJump, agents and
strict host keys all work), is the ControlMaster of one connection: :meth:`Tunnel.transport` runs
the provisioner's commands through it (starting the kernel, and a poll every few seconds, cost no
new SSH handshake), and :meth:`Tunnel.open` adds the five ``-L 127.0.0.1:LOCAL:HOST:REMOTE``
forwards to it (``ssh -O forward``). The process dies with the Jupyter server
(``PR_SET_PDEATHSIG``). When the connection drops, the process ends: :meth:`alive` says so
and the provisioner declares the kernel dead.

Why not gateway_provisioners or ``jupyter_client.ssh.tunnel``: gateway_provisioners' remote
launchers need the remote kernel to connect back to the Jupyter server (which a laptop behind NAT
does not offer), ssh through paramiko (no ~/.ssh/config aliases or ProxyJump, other host-key
handling than our backends) and have no Slurm launcher; ``jupyter_client.ssh.tunnel`` starts one
backgrounded ``ssh -f ... sleep N`` per port through pexpect, takes no ssh config file, identity
options or known_hosts, and leaves no process to watch for a dropped connection.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

from jupyter_client.connect import LocalPortCache

from workbench.errors import RemoteKernelError, TargetError
from workbench.runs.procs import die_with_parent
from workbench.targets.backends.remote import SSHTransport


class _Multiplexed(SSHTransport):
    """An SSHTransport whose commands ride on the tunnel's connection (a new one if it is gone)."""

    def __init__(self, base: SSHTransport, control: Path) -> None:
        super().__init__(base.host, base.options)
        self.control = control

    def ssh_argv(self) -> list[str]:
        argv = super().ssh_argv()
        return [*argv[:-1], "-o", f"ControlPath={self.control}", argv[-1]]


class Tunnel:
    """Local loopback ports forwarded to ``remote_host:PORT`` as seen from ``transport``'s host."""

    def __init__(self, transport: SSHTransport, name: str) -> None:
        self.base = transport
        # Short (a socket path has ~100 bytes), and naming the kernel, so `ps` says whose it is.
        self._dir = Path(tempfile.mkdtemp(prefix=f"wbk-{name}-"))
        self.control = self._dir / "ctl"
        self.proc: subprocess.Popen[bytes] | None = None
        self.local: dict[str, int] = {}

    def transport(self) -> SSHTransport:
        return _Multiplexed(self.base, self.control)

    def connect(self, timeout: float = 60.0) -> SSHTransport:
        """Start the connection (the ControlMaster); returns a transport that runs on it."""
        argv = self.base.ssh_argv()
        argv = [*argv[:-1], "-N", "-M", "-o", f"ControlPath={self.control}", argv[-1]]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=die_with_parent)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.close()
                raise TargetError(self.base.explain(err.strip()))
            if self.control.exists() and self._control("check").returncode == 0:
                return self.transport()
            time.sleep(0.1)
        self.close()
        raise TargetError(f"{self.base.where} did not accept an SSH connection within "
                          f"{timeout:.0f} s; check the network and that the host is up")

    def open(self, remote_host: str, ports: dict[str, int]) -> dict[str, int]:
        """Forward every port in ``ports`` (name -> remote port); returns name -> local port."""
        cache = LocalPortCache.instance()
        self.local = {name: cache.find_available_port("127.0.0.1") for name in ports}
        forwards: list[str] = []
        for name, remote in ports.items():
            forwards += ["-L", f"127.0.0.1:{self.local[name]}:{remote_host}:{remote}"]
        res = self._control("forward", *forwards)
        if res.returncode != 0 or not all(_listening(p) for p in self.local.values()):
            raise RemoteKernelError(f"could not forward the kernel's ports over SSH from "
                                    f"{self.base.where}: {res.stderr.decode(errors='replace')}")
        return dict(self.local)

    def _control(self, command: str, *options: str) -> subprocess.CompletedProcess[bytes]:
        argv = self.base.ssh_argv()
        return subprocess.run([*argv[:-1], "-o", f"ControlPath={self.control}", *options, "-O",
                               command, argv[-1]], capture_output=True, timeout=60,
                              stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        cache = LocalPortCache.instance()
        for port in self.local.values():
            cache.return_port(port)
        self.local = {}
        self.control.unlink(missing_ok=True)
        try:
            self._dir.rmdir()
        except OSError:
            pass


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
