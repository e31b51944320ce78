"""The five ZMQ ports of a remote kernel, forwarded to this machine's loopback over one SSH connection.

One ``ssh -N -L 127.0.0.1:LOCAL:HOST:REMOTE ...`` process (five ``-L``), run by the same OpenSSH
client and options as the backends (:class:`~workbench.backends.remote.SSHTransport`: ~/.ssh/config
aliases, ProxyJump, agents and strict host keys all work). It is also the ControlMaster of that
connection: :meth:`Tunnel.transport` runs the provisioner's polls through it, so a poll every few
seconds costs no new SSH handshake. ``ExitOnForwardFailure`` makes a port that cannot be forwarded
fail the start instead of leaving a half-connected kernel, and the process dies with the Jupyter
server (``PR_SET_PDEATHSIG``). When the connection drops, the process ends: :meth:`alive` says so
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

from workbench.backends.remote import SSHTransport
from workbench.errors import RemoteKernelError
from workbench.procs import die_with_parent


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

    def open(self, remote_host: str, ports: dict[str, int], timeout: float = 30.0) -> dict[str, int]:
        """Forward every port in ``ports`` (name -> remote port); returns name -> local port."""
        cache = LocalPortCache.instance()
        self.local = {name: cache.find_available_port("127.0.0.1") for name in ports}
        argv = self.base.ssh_argv()
        forwards: list[str] = []
        for name, remote in ports.items():
            forwards += ["-L", f"127.0.0.1:{self.local[name]}:{remote_host}:{remote}"]
        argv = [*argv[:-1], "-N", "-M", "-o", f"ControlPath={self.control}", "-o",
                "ExitOnForwardFailure=yes", *forwards, argv[-1]]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=die_with_parent)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.close()
                raise RemoteKernelError("could not forward the kernel's ports over SSH: "
                                        + self.base.explain(err.strip()))
            if all(_listening(p) for p in self.local.values()):
                return dict(self.local)
            time.sleep(0.1)
        self.close()
        raise RemoteKernelError(f"the SSH tunnel to {self.base.where} did not open within "
                                f"{timeout:.0f} s; check the network and that the host is up")

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
