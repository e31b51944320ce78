"""``python -m workbench.runs.launcher NPROC MODULE ARG...``: start one node's ranks without torchrun.

A single-node run needs nothing of torchrun's rendezvous, yet torchrun imports torch before it
starts a rank (over a second, more under load), and every local run would wait for it. This launcher
is the torch-free stand-in for one node (multi-node runs over SSH/Slurm keep torchrun): it gives
each rank the environment torchrun's standalone agent gives (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on a free port, ...) and keeps torchrun's contracts with the
supervisor (:mod:`workbench.runs.supervise`):

- exit 0 when every rank exits 0; when one fails, the others get SIGTERM (SIGKILL after
  :data:`STOP_GRACE_S`) and the launcher exits 1;
- the first failure's error file (each rank's ``record`` writes its own) is copied to
  ``$TORCHELASTIC_ERROR_FILE``, where the supervisor reads the run's root cause;
- SIGTERM/SIGINT/SIGHUP go to every rank; ranks die with the launcher (PR_SET_PDEATHSIG), so a
  launcher killed from outside leaves nothing training and the supervisor sees its signal.

Ranks share the launcher's stdout/stderr (the run's launcher.log) until they open their own logs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from workbench.runs.procs import die_with_parent

STOP_GRACE_S = 10.0  # after a rank failed or a stop was asked: SIGTERM, then SIGKILL
_POLL_S = 0.05


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, nproc: int, port: int, error_file: str | None) -> dict[str, str]:
    """What torchrun's agent sets for rank ``rank`` of a standalone single-node run."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
           "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
           "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "workbench",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                             "1")}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks must not each take every core
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    return env


def _first_failure(files: list[Path]) -> Path | None:
    """The error file written first (torchrun's ``get_first_failure`` picks the same)."""

    def when(path: Path) -> float:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return float(data["message"]["extraInfo"]["timestamp"])
        except (OSError, ValueError, KeyError, TypeError):
            return path.stat().st_mtime

    found = [p for p in files if p.is_file()]
    return min(found, key=when) if found else None


def run(nproc: int, argv: list[str]) -> int:
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    rank_errors = [Path(f"{target}.rank{r}") for r in range(nproc)] if target else []
    for path in rank_errors:
        path.unlink(missing_ok=True)
    port = free_port()
    stop: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        if not stop:
            stop.append(time.time())
            for p in ranks:
                _send(p, signal.SIGTERM)

    ranks: list[subprocess.Popen] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    for r in range(nproc):
        env = {**os.environ, **rank_env(r, nproc, port, str(rank_errors[r]) if target else None)}
        ranks.append(subprocess.Popen([sys.executable, *argv], env=env,
                                      preexec_fn=die_with_parent))
    if stop:  # the stop came while the ranks were being started: on_signal missed some
        for p in ranks:
            _send(p, signal.SIGTERM)
    failed = False
    while None in [p.poll() for p in ranks]:  # a list: every rank polled, so every exit is seen
        if not failed and any(p.returncode not in (None, 0) for p in ranks):
            failed = True
            stop.append(time.time())
            for p in ranks:
                _send(p, signal.SIGTERM)
        if stop and time.time() - stop[0] > STOP_GRACE_S:
            for p in ranks:
                _send(p, signal.SIGKILL)
        time.sleep(_POLL_S)
    codes = [p.returncode for p in ranks]
    if all(c == 0 for c in codes):
        rc = 0
    else:
        rc = 1
        first = _first_failure(rank_errors)
        if first is not None and target:
            shutil.copyfile(first, target)
        for r, c in enumerate(codes):
            if c:
                print(f"workbench.runs.launcher: rank {r} exited with {c}", file=sys.stderr,
                      flush=True)
    for path in rank_errors:
        path.unlink(missing_ok=True)
    return rc


def _send(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: python -m workbench.runs.launcher NPROC -m MODULE [ARG...]\n")
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
