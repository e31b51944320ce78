"""The ``ssh:NAME`` serve target: the guard runs on the target's first host, reached by a tunnel.

With ``keep=False`` the guard runs in the foreground of an ``ssh`` session whose stdin this
process holds: when the kernel ends, the session's stdin closes and the guard stops vLLM. With
``keep=True`` it runs detached (``setsid nohup``) until ``undeploy``. The server listens on the
host's loopback; this process reaches it through an SSH tunnel opened on first use.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.serve.remote import _Remote, _tunnels, close_tunnel, open_tunnel
from workbench.serve.target import read_address

if TYPE_CHECKING:
    from workbench.runs.registry import EndpointRecord
    from workbench.targets.backends.remote import SSHTransport
    from workbench.targets.named import SSHTarget

_sessions: dict[str, subprocess.Popen] = {}  # endpoint dir -> the ssh session holding its guard
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
        from workbench.targets.backends.remote import SSHTransport

        return SSHTransport(self.host, self.target)

    def remote_parent(self) -> str | None:
        return self.host.workdir or self.target.workdir

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int, gpus: int = 0) -> tuple[int, int]:
        from workbench.targets.backends.remote import shell_path

        sdir = self.server_dir(workdir)
        self._upload_folder_files(workdir, sdir)
        q = shell_path(sdir)
        # Secrets (the target's tokens) come from an owner-only file, never the command line.
        prefix = self.target.remote_shell_prefix(self.transport(), sdir, env)
        guard = " ".join(shlex.quote(c) for c in command)
        if watch_pid:
            # Foreground in an ssh session whose stdin this process holds (--watch-stdin).
            cmd = f"{prefix}cd {q}; exec {guard} >> {q}/server.log 2>&1"
            with (workdir / "ssh.log").open("ab") as fh:
                session = subprocess.Popen(
                    self.transport().ssh_argv() + ["--", "bash -c " + shlex.quote(cmd)],
                    stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT,
                    start_new_session=True)
            _sessions[str(workdir)] = session
        else:
            cmd = (f"{prefix}cd {q}; setsid nohup {guard} "
                   f">> {q}/server.log 2>&1 < /dev/null & echo $!")
            self.transport().run(cmd, timeout=60)
        return self._wait_pids(workdir, sdir)

    def _wait_pids(self, workdir: Path, sdir: str) -> tuple[int, int]:
        from workbench.targets.backends.remote import shell_path

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
        from workbench.targets.named import TargetError

        sdir = self._placement(record).get("server_dir", "")
        if not record.pid:
            return False
        # The guard, or the server (a server whose guard was killed still answers): a PID counts
        # while its process names the endpoint folder (the guard's argument, the server's cache
        # in its environment), so a PID the host has handed to another process does not.
        pids = " ".join(str(p) for p in (record.pid, record.server_pid) if p)
        check = (f"for p in {pids}; do cat /proc/$p/cmdline /proc/$p/environ 2>/dev/null | "
                 f"tr '\\0' '\\n' | grep -qF -- {shlex.quote(sdir)} && exit 0; done; exit 1")
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
        from workbench.targets.named import TargetError

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
