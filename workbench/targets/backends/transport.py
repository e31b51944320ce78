"""Running a shell command on one host of a target: :class:`SSHTransport` through the system
``ssh`` client (so ~/.ssh/config aliases, ProxyJump and agents work; host keys are checked strictly
unless the target says otherwise, and ssh's own failures come back as a TargetError that says what
to do, e.g. the ``ssh-keyscan`` line that adds an unknown host key), :class:`LocalTransport`
through ``bash`` on this machine (a Slurm login node the notebook runs on).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from workbench.targets.named import HostSpec, SSHOptions, TargetError
from workbench.targets.secrets import remote_quote


@dataclass
class Result:
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return (self.stderr or self.stdout).decode(errors="replace").strip()


class Transport(Protocol):
    where: str  # for messages: "host gpu1", "this machine"

    def run(self, command: str, *, input: bytes | None = None, check: bool = True,
            timeout: float = 60.0) -> Result: ...


def _run(argv: list[str], input: bytes | None, timeout: float, where: str) -> Result:
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TargetError(f"{where} did not answer within {timeout:.0f} s ({argv[0]} timed out); "
                          "check the network and that the host is up") from None
    except FileNotFoundError:
        raise TargetError(f"{argv[0]!r} is not installed on this machine; install it "
                          "(e.g. apt-get install openssh-client)") from None
    return Result(proc.returncode, proc.stdout, proc.stderr)


class LocalTransport:
    where = "this machine"

    def run(self, command: str, *, input: bytes | None = None, check: bool = True,
            timeout: float = 60.0) -> Result:
        res = _run(["bash", "-c", command], input, timeout, self.where)
        if check and res.returncode != 0:
            raise TargetError(f"command failed on {self.where}: {command}\n{res.text}")
        return res


class SSHTransport:
    """ssh to one host with BatchMode (never prompts) and the target's key and host-key policy."""

    def __init__(self, host: HostSpec, options: SSHOptions) -> None:
        self.host = host
        self.options = options
        self.where = f"host {host.host}"

    def ssh_argv(self) -> list[str]:
        o = self.options
        argv = ["ssh"]
        if o.ssh_config:
            argv += ["-F", str(Path(o.ssh_config).expanduser())]
        if self.host.port:
            argv += ["-p", str(self.host.port)]
        if o.identity_file:
            argv += ["-i", str(Path(o.identity_file).expanduser())]
        opts = {"BatchMode": "yes", "ConnectTimeout": str(o.connect_timeout),
                "StrictHostKeyChecking": "yes" if o.strict_host_key_checking else "no",
                "ServerAliveInterval": "15", "LogLevel": "ERROR"}
        if o.known_hosts:
            opts["UserKnownHostsFile"] = str(Path(o.known_hosts).expanduser())
        opts.update({k: ssh_option_value(v) for k, v in o.ssh_options.items()})
        for k, v in opts.items():
            argv += ["-o", f"{k}={v}"]
        return argv + [self.host.destination]

    def run(self, command: str, *, input: bytes | None = None, check: bool = True,
            timeout: float = 60.0) -> Result:
        # ssh joins its arguments into one string for the remote login shell; bash -c makes the
        # command's meaning independent of that shell (csh, fish, ...).
        res = _run(self.ssh_argv() + ["--", "bash -c " + shlex.quote(command)], input, timeout,
                   self.where)
        if res.returncode == 255:  # ssh's own failure: connection, auth or host key
            raise TargetError(self.explain(res.text))
        if check and res.returncode != 0:
            raise TargetError(f"command failed on {self.where}: {command}\n{res.text}")
        return res

    def explain(self, err: str) -> str:
        """ssh's error with the next step to take."""
        h = self.host.host
        if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err:
            name, port, known = self._known_hosts_entry()
            entry = name if port == "22" else f"[{name}]:{port}"
            fix = (f"the host key of {h} is not the one {known} holds: the host was reinstalled, "
                   "or someone is in between. Once its admin confirms the new key, remove the "
                   f"old one with\n   ssh-keygen -R {shlex.quote(entry)} -f {remote_quote(known)}"
                   "\nand add the new one with\n   "
                   f"ssh-keyscan -p {port} {shlex.quote(name)} >> {remote_quote(known)}")
        elif "Host key verification failed" in err or "No matching host key" in err:
            name, port, known = self._known_hosts_entry()
            scan = f"ssh-keyscan -p {port} {shlex.quote(name)}"
            fix = (f"the host key of {h} is not in {known} (strict host key checking is on). "
                   f"See its fingerprint with\n   {scan} | ssh-keygen -lf -\nand once it is the "
                   f"one the host's admin gives, add it with\n   {scan} >> {remote_quote(known)}"
                   "\n(or set known_hosts: of the target to a file that has it)")
        elif "Permission denied" in err:
            fix = (f"{h} refused the login; set identity_file: (or add the key to your ssh agent) "
                   "and check the user name")
        elif "Could not resolve hostname" in err:
            fix = f"{h!r} is neither a resolvable host name nor an alias in your ssh config"
        else:
            fix = (f"{h} is unreachable; check that it is up, the port, and the network "
                   "(ssh must log in without a prompt)")
        return f"cannot reach {h} over SSH: {err or 'ssh failed'}\n-> {fix}"

    def _effective(self) -> dict[str, str]:
        """What ssh makes of this host with the target's options and ssh config (``ssh -G``):
        the first value of each (lower-case) keyword; {} when ssh cannot say."""
        try:
            res = _run(self.ssh_argv()[:-1] + ["-G", self.host.destination], None, 10, self.where)
        except TargetError:
            return {}
        out: dict[str, str] = {}
        for line in res.stdout.decode(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if value:
                out.setdefault(key, value.split()[0] if key == "userknownhostsfile" else value)
        return out

    def _known_hosts_entry(self) -> tuple[str, str, str]:
        """(host name, port, known_hosts file) as ssh uses them for this host: what ssh-keyscan
        needs (it reads no ssh config and takes no USER@) and where ssh looks for the key."""
        g = self._effective()
        name = g.get("hostname") or self.host.host.split("@")[-1]
        port = g.get("port") or str(self.host.port or 22)
        known = g.get("userknownhostsfile") or str(
            Path(self.options.known_hosts or "~/.ssh/known_hosts").expanduser())
        return name, port, known

    def resolved_hostname(self) -> str:
        """The address behind an alias (``ssh -G``), for other nodes to reach this one."""
        if self.host.address:
            return self.host.address
        return self._effective().get("hostname") or self.host.host.split("@")[-1]


def ssh_option_value(value: str | bool | int | float) -> str:
    """A targets.yaml ``ssh_options`` value as ssh reads it: true/false as yes/no (YAML reads
    ``yes`` as true), numbers as written."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
