"""The guard process: runs one vLLM server, stops it when told to, and records how it ended.

Started on the server's machine as ``python -m workbench.serve --guard DIR ...`` (see
:func:`workbench.serve.server.guard_command`); everything it says, it writes as files in the
endpoint folder, so any process (this kernel, a later one, the lab panel) reads the same state.
It imports nothing heavy: it starts on every deploy.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.serve.server import PORT_FROM_GUARD, _url_host, free_port


def _guard_main(argv: Sequence[str]) -> int:
    """Run the server command in DIR; stop it when told to; record how it ended.

    Writes DIR/guard.pid, DIR/server.pid, DIR/address.json (node, bind host, port: ``--port 0``
    picks a free one, substituted for PORT_FROM_GUARD in the command), DIR/healthy.json once the
    server answers /health (so any process sees it is up, with no tunnel to it) and, at the end,
    DIR/exit.json. DIR/api_key, when present, reaches the server as VLLM_API_KEY. The guard
    leads its process group, so stopping the group stops the server with it. It stops the server
    when the process ``--watch-pid`` ends, or when its stdin closes (``--watch-stdin``: the SSH
    session of the kernel that deployed it).
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m workbench.serve")
    p.add_argument("--guard", required=True, type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--watch-pid", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("--gpus", type=int, default=0, help="lease this many of the machine's GPUs")
    p.add_argument("command", nargs=argparse.REMAINDER)
    from workbench.runs.rundir import write_json_atomic, write_text_atomic

    args = p.parse_args(argv)
    d: Path = args.guard
    write_text_atomic(d / "guard.pid", str(os.getpid()))
    port = args.port or free_port(args.host)
    command = [str(port) if c == PORT_FROM_GUARD else c for c in (
        args.command[1:] if args.command[:1] == ["--"] else args.command)]
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    if (d / "api_key").is_file():
        env["VLLM_API_KEY"] = (d / "api_key").read_text().strip()
    short_tmp = _short_tmpdir(env)
    lease = _lease(d, args.gpus)
    if isinstance(lease, str):  # no free card: nothing started, say who holds them
        print(lease, file=sys.stderr, flush=True)
        write_json_atomic(d / "exit.json", {"code": None, "reason": lease, "time": time.time()})
        return 1
    try:
        if lease is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(lease[1])
            command = _with_memory_fraction(command, lease[1][0])
        return _serve(d, args, port, command, env)
    finally:
        if short_tmp is not None:
            shutil.rmtree(short_tmp, ignore_errors=True)
        if lease is not None:
            from workbench.targets import leases

            leases.release(f"endpoint:{d.name}", lease[0])


# vLLM binds its ZeroMQ sockets at TMPDIR/<a 36-character id>, and a Unix socket's path holds at
# most 107 bytes.
SOCKET_TMPDIR_MAX = 107 - 37


def _short_tmpdir(env: dict[str, str]) -> str | None:
    """When the endpoint's own TMPDIR is too long a path for vLLM's sockets (a deep home or
    course space), a private one under /tmp (0700, removed when the guard ends) in its place;
    None when it fits."""
    if len(env.get("TMPDIR", "")) <= SOCKET_TMPDIR_MAX:
        return None
    env["TMPDIR"] = tempfile.mkdtemp(prefix="wb-serve-", dir="/tmp")
    return env["TMPDIR"]


def _lease(d: Path, gpus: int) -> Any:
    """(holder, devices) of this endpoint's GPU lease (workbench.targets.leases: disjoint from every live
    local run's and endpoint's), None when it needs none (CPU, or Slurm, which gives the job its
    own cards), or why none could be had."""
    if gpus <= 0 or "SLURM_JOB_ID" in os.environ:
        return None
    from workbench.errors import ResourceError
    from workbench.runs.procs import ProcessIdentity
    from workbench.targets import leases

    me = ProcessIdentity.me("guard")
    try:
        return me, leases.acquire(f"endpoint:{d.name}", gpus, me)
    except ResourceError as exc:
        return f"no free GPU for endpoint {d.name}: {exc}"


# GiB left free beside vLLM on its card (the CUDA context of other processes, fragmentation).
HEADROOM_GIB = 1.0


def memory_fraction(device: str) -> float | None:
    """The ``--gpu-memory-utilization`` vLLM can have on ``device`` with what other processes
    already hold there (vLLM's default, 0.9 of the card, assumes an empty card and fails to start
    beside a training run); None when nvidia-smi cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                              "--format=csv,noheader,nounits", "-i", device],
                             capture_output=True, text=True, timeout=30)
        used, total = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return max(0.0, min(0.9, (total - used - HEADROOM_GIB * 1024) / total))


def _with_memory_fraction(command: list[str], device: str) -> list[str]:
    if any(c.startswith("--gpu-memory-utilization") for c in command):
        return command  # the user's extra_args said it
    fraction = memory_fraction(device)
    if fraction is None:
        return command
    return [*command, "--gpu-memory-utilization", f"{fraction:.3f}"]


def _serve(d: Path, args: Any, port: int, command: list[str], env: dict[str, str]) -> int:
    from workbench.runs.rundir import write_json_atomic, write_text_atomic

    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    write_text_atomic(d / "server.pid", str(server.pid))
    write_json_atomic(d / "address.json", {"node": socket.gethostname(), "host": args.host,
                                           "port": port})
    reason = {"value": "exited"}
    watched_gone = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        reason["value"] = "signal"
        server.terminate()

    def read_stdin_to_eof() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        watched_gone.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    if args.watch_stdin:
        threading.Thread(target=read_stdin_to_eof, daemon=True).start()
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    health = f"http://{_url_host(local)}:{port}/health"
    healthy = False
    while server.poll() is None:
        if not healthy and _answers(health):
            healthy = True
            write_json_atomic(d / "healthy.json", {"time": time.time()})
        if (args.watch_pid and not _pid_alive(args.watch_pid)) or watched_gone.is_set():
            reason["value"] = "watched process ended"
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
            break
        time.sleep(0.5)
    code = server.wait()
    write_json_atomic(d / "exit.json", {"code": code, "reason": reason["value"], "time": time.time()})
    return 0


def _answers(url: str, timeout: float = 1.0) -> bool:
    """Whether GET ``url`` answers 200 (the health probe of the guard and of Endpoint.healthy)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as ended.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
