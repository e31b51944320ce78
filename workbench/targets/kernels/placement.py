"""Where a remote kernel runs: start it on an SSH host or in a Slurm allocation, watch it, stop it.

A placement owns the kernel process on the target and nothing on this machine (the port
forwarding is :mod:`workbench.targets.kernels.tunnel`). Both kinds write the connection file (key from the
KernelManager, ports 0 so ipykernel binds free ones and writes them back) into a private folder on
the target, start ``python -m workbench.targets.kernels.remote_kernel`` with ``WORKBENCH_TARGET`` set, and
read back the ports, the kernel's :class:`~workbench.runs.procs.ProcessIdentity` and its activity.

- :class:`SSHPlacement`: the first host of an ``ssh:`` target; the kernel is started detached
  (its own session) and signalled by its recorded identity, checked on that host.
- :class:`SlurmPlacement`: ``sbatch`` of one node with the GPUs asked and a time limit, whose
  script ``exec``\\ s ``srun`` of the kernel, so the allocation ends when the kernel does. Signals
  go to that step through ``scancel --signal=SIG JOB.0`` (Slurm's own name for the process).
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from typing import Any

from workbench.errors import RemoteKernelError, TargetError
from workbench.targets.backends.remote import SSHTransport, Transport
from workbench.targets.named import SlurmTarget, SSHTarget
from workbench.targets.secrets import split_env, write_secret_env

MODULE = "workbench.targets.kernels.remote_kernel"
PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
TAG = "WORKBENCH-KERNEL "
SEP = "WORKBENCH-NEXT-FILE"

# Run with the target's Python; REQ (a JSON string) is prepended, so the key never shows in `ps`.
CHECK = r'''
import importlib, json
out = {}
for mod in ("ipykernel", "workbench.targets.kernels.kernel"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        out = {"missing": mod, "error": f"{type(exc).__name__}: {exc}"}
        break
'''
START = CHECK + r'''
import os, subprocess, sys, time
req = json.loads(REQ)
d = os.path.expanduser(req["dir"])
if not out:
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.makedirs(os.path.expanduser(req["cwd"]), exist_ok=True)
    conn = os.path.join(d, "connection.json")
    for name in ("identity.json", "activity.json", "ended.json", "heartbeat"):
        if os.path.exists(os.path.join(d, name)):
            os.remove(os.path.join(d, name))  # a restart must not read the last kernel's
    os.umask(0o077)
    with open(conn, "w") as fh:
        json.dump(req["connection"], fh)
    log = open(os.path.join(d, "kernel.log"), "ab")
    p = subprocess.Popen([sys.executable, "-m", req["module"], "-f", conn],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                         env={**os.environ, **req["env"]}, cwd=os.path.expanduser(req["cwd"]))
    deadline = time.time() + req["timeout"]
    out = {"timeout": req["timeout"]}
    while time.time() < deadline:
        if p.poll() is not None:
            with open(os.path.join(d, "kernel.log"), errors="replace") as fh:
                out = {"exited": p.returncode, "log": fh.read()[-2000:]}
            break
        try:
            with open(conn) as fh:
                info = json.load(fh)
            with open(os.path.join(d, "identity.json")) as fh:
                out = {"ports": {k: info[k] for k in PORTS}, "identity": json.load(fh)}
            if all(out["ports"].values()):
                break
        except (OSError, ValueError, KeyError):
            pass
        out = {"timeout": req["timeout"]}
        time.sleep(0.2)
print(TAG + json.dumps(out))
'''
PREPARE = CHECK + r'''
import os
req = json.loads(REQ)
if not out:
    os.umask(0o077)
    os.makedirs(req["dir"], exist_ok=True)
    for name in ("identity.json", "activity.json", "ended.json", "heartbeat"):
        if os.path.exists(os.path.join(req["dir"], name)):
            os.remove(os.path.join(req["dir"], name))
    for name, text in req["files"].items():
        with open(os.path.join(req["dir"], name), "w") as fh:
            fh.write(text)
print(TAG + json.dumps(out))
'''
WATCH = r'''
import json, os
req = json.loads(REQ)
from workbench.runs.procs import ProcessIdentity, terminate
ident = ProcessIdentity.from_dict(req["identity"])
out = {}
if req["op"] == "signal":
    out["sent"] = ident.signal(req["signal"])
elif req["op"] == "stop":
    terminate([ident], grace_s=req["grace"])
out["alive"] = ident.alive()
for name in ("activity", "ended"):
    try:
        with open(os.path.join(os.path.expanduser(req["dir"]), name + ".json")) as fh:
            out[name] = json.load(fh)
    except (OSError, ValueError):
        out[name] = None
print(TAG + json.dumps(out))
'''


def _script(body: str, req: dict[str, Any]) -> bytes:
    head = f"REQ = {json.dumps(json.dumps(req))}\nPORTS = {PORTS!r}\nTAG = {TAG!r}\n"
    return (head + body).encode()


def _answer(res: Any, what: str) -> dict[str, Any]:
    line = next((ln for ln in res.stdout.decode(errors="replace").splitlines()
                 if ln.startswith(TAG)), None)
    if line is None:
        raise RemoteKernelError(f"{what} gave no answer: {res.text[-1500:] or 'no output'}")
    out: dict[str, Any] = json.loads(line[len(TAG):])
    return out


def missing_ipykernel(ref: str, python: str, where: str, found: dict[str, Any]) -> RemoteKernelError:
    mod = found["missing"]
    pkg = "ipykernel" if mod == "ipykernel" else "-e /path/to/workbench"
    return RemoteKernelError(
        f"the Python of {ref} on {where} ({python}) cannot import {mod}: {found['error']}\n-> "
        f"install it there: {python} -m pip install {pkg} (or point 'python:' of {ref} in "
        "targets.yaml at an environment that has it)")


class SSHPlacement:
    """The kernel on the first host of an ``ssh:`` target, bound to that host's loopback."""

    def __init__(self, target: SSHTarget, transport: SSHTransport, kernel_id: str) -> None:
        self.target, self.transport = target, transport
        base = target.hosts[0].workdir or target.workdir
        self.dir = f"{base.rstrip('/')}/.kernels/{kernel_id}"
        self.identity: dict[str, Any] | None = None
        self.remote_host = "127.0.0.1"  # the tunnel's far end, seen from the host itself
        self.job: str | None = None

    def _python(self, script: bytes, timeout: float) -> Any:
        t = self.target
        # Secrets from an owner-only file beside the kernel's folder, never on the command line.
        prefix = t.remote_shell_prefix(self.transport, self.dir)
        return self.transport.run(f"{prefix}{shlex.quote(t.python)} -", input=script,
                                  check=False, timeout=timeout)

    def start(self, connection: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, int]:
        req = {"dir": self.dir, "connection": {**connection, "ip": "127.0.0.1"}, "env": env,
               "module": MODULE, "cwd": self.target.hosts[0].workdir or self.target.workdir,
               "timeout": timeout}
        out = _answer(self._python(_script(START, req), timeout + 60), f"starting the kernel on "
                      f"{self.transport.where}")
        where = self.transport.where
        if "missing" in out:
            raise missing_ipykernel(self.target.ref, self.target.python, where, out)
        if "exited" in out:
            raise RemoteKernelError(f"the kernel on {where} exited at start (code {out['exited']})"
                                    f":\n{out['log']}\n-> fix the error above in the Python of "
                                    f"{self.target.ref}")
        if "ports" not in out:
            raise RemoteKernelError(f"the kernel on {where} did not write its ports within "
                                    f"{timeout:.0f} s; see {self.dir}/kernel.log there")
        self.identity = out["identity"]
        return {k: int(v) for k, v in out["ports"].items()}

    def watch(self, op: str = "poll", sig: int = 0, grace: float = 5.0) -> dict[str, Any]:
        """Alive and activity of the kernel (after sending ``sig`` or stopping it, per ``op``)."""
        req = {"identity": self.identity, "op": op, "signal": sig, "grace": grace, "dir": self.dir}
        return _answer(self._python(_script(WATCH, req), 60 + grace), f"asking {self.transport.where}"
                       " about the kernel")

    def alive_and_activity(self) -> tuple[bool, dict[str, Any] | None]:
        out = self.watch()
        return bool(out["alive"]), out.get("activity")

    def signal(self, sig: int) -> None:
        self.watch("signal", sig)

    def stop(self, grace: float) -> None:
        self.watch("stop", grace=grace)

    def release(self) -> None:
        """Nothing is held beyond the process on an SSH host."""


class SlurmPlacement:
    """The kernel as step 0 of a one-node Slurm job that ends with it."""

    def __init__(self, target: SlurmTarget, kernel_id: str, gpus: int, time_limit: str,
                 cpus: int, transport: Transport) -> None:
        from workbench.runs.home import home
        from workbench.targets.backends.slurm import SlurmBackend

        self.target = target.model_copy(update={"time": time_limit})
        self.backend = SlurmBackend(target.ref, self.target)  # for its sbatch error advice
        self.transport = transport  # the login node (over the tunnel's connection), or here
        base = target.workdir or ("~/workbench-runs" if target.login else str(home() / "runs"))
        self.dir = f"{base.rstrip('/')}/.kernels/{kernel_id}"
        self.kernel_id, self.gpus, self.cpus = kernel_id, gpus, cpus
        self.job: str | None = None
        self.remote_host = ""  # the node's address, known once the job runs
        self.identity: dict[str, Any] | None = None  # the kernel's, as it recorded it
        self.started: float | None = None  # when Slurm started the allocation (the bill starts)

    def _sh(self, command: str, timeout: float = 60.0) -> Any:
        # Without the secret env, as the backend's scheduler calls: the job sources its file.
        return self.transport.run(f"{self.target.shell_prefix()}{command}",
                                  check=False, timeout=timeout)

    def look(self, *files: str) -> tuple[dict[str, str], list[Any]]:
        """The job as ``scontrol`` sees it ({} once Slurm forgot it) and the JSON ``files`` of the
        kernel's folder (None where missing), in one round trip."""
        from workbench.targets.backends.slurm_script import parse_scontrol

        d = shlex.quote(self.dir)
        cats = "".join(f"; echo {SEP}; cat {d}/{f} 2>/dev/null" for f in files)
        res = self._sh(f"scontrol show job -o {self.job} 2>&1{cats}; true")
        head, *parts = res.stdout.decode(errors="replace").split(SEP)
        if "JobState=" in head:
            info = parse_scontrol(head.strip().splitlines()[0])
        elif "invalid job id" in head.lower():
            info = {}
        else:  # slurmctld busy or unreachable says nothing about the job
            raise TargetError(f"could not ask Slurm about job {self.job}: {head.strip()}")
        found = []
        for part in parts:
            try:
                found.append(json.loads(part))
            except ValueError:
                found.append(None)
        return info, found

    def script(self, env: dict[str, str]) -> str:
        from workbench.targets.backends.slurm_script import allocation_lines
        from workbench.targets.secrets import MASK, env_file_path

        t, d = self.target, self.dir
        plain, secret = split_env(t.env)
        lines = ["#!/bin/bash", f"# Workbench kernel {self.kernel_id} on {t.ref}: the allocation "
                 "ends when the kernel does.", f"#SBATCH --job-name=wb-kernel-{self.kernel_id}",
                 "#SBATCH --nodes=1", "#SBATCH --ntasks=1", f"#SBATCH --cpus-per-task={self.cpus}",
                 *allocation_lines(t, self.gpus), f"#SBATCH --output={d}/slurm-%j.out",
                 f"#SBATCH --chdir={d}", *(f"#SBATCH {o}" for o in t.sbatch_options), "",
                 "set -eo pipefail", *t.setup,
                 *(f"export {k}={shlex.quote(v)}" for k, v in {**plain, **env}.items()),
                 *([f"# {' '.join(f'{k}={MASK}' for k in secret)}: from a file only you can read",
                    f". {shlex.quote(env_file_path(d))}"] if secret else []),
                 f"exec srun --ntasks=1 --cpus-per-task={self.cpus} {shlex.quote(t.python)} -m "
                 f"{MODULE} -f {shlex.quote(d + '/connection.json')}", ""]
        return "\n".join(lines)

    def start(self, connection: dict[str, Any], env: dict[str, str], timeout: float,
              wait_s: float = 300.0) -> dict[str, int]:
        t, tr = self.target, self.transport
        if self.dir.startswith("~"):  # #SBATCH lines are not expanded by a shell
            home = tr.run('printf %s "$HOME"', timeout=60).stdout.decode().strip()
            self.dir = home + self.dir[1:]
        # One round trip: can the Python start a kernel, then the connection file and script.
        req = {"dir": self.dir, "files": {"connection.json": json.dumps({**connection,
                                                                         "ip": "0.0.0.0"}),
                                          "kernel.sbatch": self.script(env)}}
        res = tr.run(f"{t.shell_prefix()}{shlex.quote(t.python)} -",
                     input=_script(PREPARE, req), check=False, timeout=120)
        found = _answer(res, f"checking the Python of {t.ref} on {tr.where}")
        if found:
            raise missing_ipykernel(t.ref, t.python, tr.where, found)
        write_secret_env(tr, t.env, self.dir)
        d = shlex.quote(self.dir)
        res = self._sh(f"sbatch --parsable {d}/kernel.sbatch")
        job = res.stdout.decode(errors="replace").strip().split(";")[0]
        if res.returncode != 0 or not job.isdigit():
            raise RemoteKernelError(self.backend.explain_sbatch(res.text))
        self.job = job
        info = self._wait_running(wait_s)
        self.started = slurm_epoch(info.get("StartTime")) or time.time()
        node = info.get("BatchHost") or info.get("NodeList", "")
        addr = self._sh(f"scontrol show node -o {shlex.quote(node)}").stdout.decode(errors="replace")
        from workbench.targets.backends.slurm_script import parse_scontrol

        self.remote_host = parse_scontrol(addr).get("NodeAddr") or node
        return self._wait_ports(timeout)

    def _wait_running(self, wait_s: float) -> dict[str, str]:
        from workbench.targets.backends.slurm_script import ACTIVE, WAITING

        deadline = time.time() + wait_s
        while True:
            info = self.look()[0]
            state = info.get("JobState", "")
            if state == "RUNNING":
                return info
            if state not in WAITING and state not in ACTIVE:
                raise RemoteKernelError(f"Slurm job {self.job} for the kernel ended {state or '?'}"
                                        f" before it started:\n{self._out_tail()}")
            if time.time() >= deadline:
                reason = info.get("Reason", "?")
                self.release()
                raise RemoteKernelError(
                    f"Slurm did not start the kernel's allocation (job {self.job}) within "
                    f"{wait_s:.0f} s (still {state}, reason: {reason}); it was cancelled.\n-> ask "
                    "for fewer GPUs or a shorter --time, pick another partition, or reinstall the "
                    "kernel with a longer --wait")
            time.sleep(1.0)

    def _wait_ports(self, timeout: float) -> dict[str, int]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job, (info, identity) = self.look("connection.json", "identity.json")
            if job.get("JobState") != "RUNNING":
                raise RemoteKernelError(f"the kernel in Slurm job {self.job} exited at start:\n"
                                        f"{self._out_tail()}\n-> fix the error above in the "
                                        f"Python of {self.target.ref}")
            if identity and info and all(info.get(k) for k in PORTS):
                self.identity = identity
                return {k: int(info[k]) for k in PORTS}
            time.sleep(0.5)
        self.release()
        raise RemoteKernelError(f"the kernel in Slurm job {self.job} did not write its ports "
                                f"within {timeout:.0f} s; the job was cancelled:\n{self._out_tail()}")

    def _out_tail(self) -> str:
        res = self.transport.run(f"tail -n 30 {shlex.quote(self.dir)}/slurm-{self.job}.out",
                                 check=False, timeout=60)
        return res.stdout.decode(errors="replace").strip() or "(no output)"

    def alive_and_activity(self) -> tuple[bool, dict[str, Any] | None]:
        from workbench.targets.backends.slurm_script import ACTIVE, WAITING

        if not self.job:
            return False, None
        info, (activity,) = self.look("activity.json")
        return info.get("JobState", "") in (WAITING | ACTIVE) - {"COMPLETING"}, activity

    def signal(self, sig: int) -> None:
        name = signal.Signals(sig).name.removeprefix("SIG")
        self._sh(f"scancel --signal={name} {self.job}.0")

    def stop(self, grace: float) -> None:
        self.signal(signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and self.alive_and_activity()[0]:
            time.sleep(0.5)
        self.release()

    def release(self) -> None:
        """scancel the allocation and wait until Slurm confirms it left the queue."""
        from workbench.targets.backends.slurm_script import ACTIVE, WAITING

        if not self.job:
            return
        deadline = time.time() + 30.0
        self._sh(f"scancel {self.job}")
        while True:
            try:
                if self.look()[0].get("JobState", "") not in WAITING | ACTIVE:
                    return
            except TargetError:
                pass  # slurmctld busy: ask again
            if time.time() >= deadline:
                raise TargetError(f"could not confirm that Slurm job {self.job} (the kernel's "
                                  f"allocation) ended; scancel {self.job} on {self.transport.where}")
            time.sleep(0.5)


def slurm_epoch(value: str | None) -> float:
    """Epoch seconds of a Slurm time (``2024-05-01T12:00:00``, local); 0.0 for none/Unknown."""
    try:
        return time.mktime(time.strptime(value or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0
