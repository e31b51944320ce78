"""The standby start of a local run: its supervisor and ranks start while launch() still works.

Every process of a run imports torch and transformers (seconds each). ``launch`` (in the kernel
or the CLI) first plans and prepares the data; only then could the supervisor, torchrun and the
ranks start and import again. A standby overlaps the two: right after the cheap spec checks,
launch starts ``python -m workbench.runs.standby FOLDER NPROC``, a supervisor that starts torchrun at
once with ranks (``python -m workbench.train --standby FOLDER``) that import their heavy
libraries and then wait for the go. Until the go they know no run directory, so they write into
none; what they print is kept (the supervisor's in FOLDER, torchrun's and the ranks' in memory)
and lands in the run's logs at the go.

- The go: when launch accepts the run, the local backend writes the run directory to the
  standby supervisor's stdin (:meth:`Standby.hand_over`). The supervisor then runs as
  ``python -m workbench.runs.supervise RUN_DIR`` would (:func:`workbench.runs.supervise.supervise`): it
  bills the attempt from its own start, leases the GPUs, and writes FOLDER/go.json with the run
  directory and the environment decided at the go (CUDA_VISIBLE_DEVICES), which the waiting
  ranks apply before anything touches CUDA (:func:`await_go`).
- A refusal: launch calls :meth:`Standby.discard`, which closes the stdin and waits until the
  supervisor, torchrun and every rank are gone, before it raises.
- The launching process dies before the go: its end of the stdin pipe closes with it, and the
  supervisor stops its ranks and exits just as for a refusal; the ranks also watch the
  supervisor (:func:`workbench.runs.procs.watch_supervisor`).

Set ``WORKBENCH_STANDBY=0`` to start every run the plain way (after launch's checks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import psutil

from workbench.runs import procs

if TYPE_CHECKING:
    from workbench.runs.rundir import RunDir
    from workbench.spec import RunSpec

STANDBY_ENV = "WORKBENCH_STANDBY"  # "0": no standby start
GO_FILE = "go.json"
ERROR_FILE = "rank-error.json"  # torchrun's TORCHELASTIC_ERROR_FILE until the run dir is known
SUPERVISOR_LOG = "supervisor.log"
_POLL_S = 0.05


# -- the launching process ----------------------------------------------------------------------
class Standby:
    """The launching side of one standby: start it, hand it a run directory, or discard it."""

    def __init__(self, proc: subprocess.Popen, folder: Path, nproc: int) -> None:
        self.proc, self.folder, self.nproc = proc, folder, nproc

    @classmethod
    def start(cls, spec: RunSpec) -> Standby | None:
        """A standby for a one-node local run (None where it cannot serve: switched off)."""
        if os.environ.get(STANDBY_ENV) == "0" or spec.resources.nodes != 1:
            return None
        folder = Path(tempfile.mkdtemp(prefix="workbench-standby-"))
        nproc = spec.resources.procs_per_node
        with (folder / SUPERVISOR_LOG).open("ab") as log:
            # A session of its own, as the backend's supervisor: after the go it outlives the
            # kernel. Before the go its stdin is the lifeline (EOF: stop everything).
            proc = subprocess.Popen(
                [sys.executable, "-m", "workbench.runs.standby", str(folder), str(nproc)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(proc, folder, nproc)

    def hand_over(self, rd: RunDir, spec: RunSpec) -> subprocess.Popen | None:
        """Give the standby ``rd``: the supervisor process, or None (discarded) if it cannot run
        this spec or is gone; the caller then starts a supervisor the plain way."""
        if self.nproc != spec.resources.procs_per_node or spec.resources.nodes != 1 \
                or self.proc.poll() is not None:
            self.discard()
            return None
        from workbench.runs.rundir import QUEUED

        # Recorded before the go, so no reader ever sees this attempt without its supervisor.
        procs.start_attempt(rd, procs.ProcessIdentity.of(self.proc.pid, "supervisor"),
                            state=QUEUED, submitted=time.time())
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"run_dir": str(rd.path)}).encode() + b"\n")
            self.proc.stdin.close()
        except OSError:  # it died in between: nothing of it can have touched the run dir
            self.discard()
            return None
        return self.proc

    def discard(self, timeout: float = 20.0) -> None:
        """Stop the standby (supervisor, torchrun, ranks) and wait until all are gone."""
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(
                recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # EOF: the supervisor stops its ranks and exits
            except OSError:
                pass
        _, left = psutil.wait_procs(tree, timeout=timeout)
        procs.kill_all(left)
        psutil.wait_procs(left, timeout=5.0)
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the standby supervisor ---------------------------------------------------------------------
class _Discarded(Exception):
    pass


class _LogPump:
    """torchrun's (and, until the go, the ranks') output: kept in memory until the log's path is
    known, then appended to it."""

    def __init__(self, source: IO[bytes]) -> None:
        self._source, self._held = source, bytearray()
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="standby-log", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while chunk := os.read(self._source.fileno(), 65536):
            with self._lock:
                self._held += chunk
                if self._path is not None:
                    self._flush()

    def _flush(self) -> None:
        assert self._path is not None
        with self._path.open("ab") as fh:
            fh.write(self._held)
        self._held.clear()

    def to(self, path: Path) -> None:
        with self._lock:
            self._path = path
            self._flush()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class Ranks:
    """The standby's torchrun, for :func:`workbench.runs.supervise.supervise`'s first attempt."""

    def __init__(self, folder: Path, proc: subprocess.Popen, pump: _LogPump) -> None:
        self.folder, self.proc, self.pump = folder, proc, pump

    def go(self, rd: RunDir, launcher_log: Path) -> None:
        """Let the ranks start on ``rd`` with the environment the supervisor decided."""
        self.pump.to(launcher_log)
        env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}
        tmp = self.folder / (GO_FILE + ".tmp")
        tmp.write_text(json.dumps({"run_dir": str(rd.path), "env": env}), encoding="utf-8")
        tmp.replace(self.folder / GO_FILE)

    def ended(self, errors: Path) -> None:
        """After torchrun exits: its output is in the log, its root cause where the run's is."""
        self.pump.join(timeout=10.0)
        if (self.folder / ERROR_FILE).is_file():
            shutil.move(self.folder / ERROR_FILE, errors)

    def stop(self) -> None:
        """Kill what is left of the standby's processes and remove its folder."""
        _kill_tree(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs.kill_all(tree)  # ranks run in sessions of their own: the group kill misses them
    psutil.wait_procs(tree, timeout=10.0)
    proc.wait()


def _start_ranks(folder: Path, nproc: int, me: procs.ProcessIdentity) -> Ranks:
    from workbench.runs.node import launcher_command

    cmd = launcher_command(nproc, ["--standby", str(folder)])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", procs.SUPERVISOR_ENV: me.token,
           "TORCHELASTIC_ERROR_FILE": str(folder / ERROR_FILE),
           # torch.cuda.is_available() without initialising CUDA, which would fix the visible
           # devices before the go says which ones this run leased.
           "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=folder,
                            start_new_session=True, preexec_fn=procs.die_with_parent)
    assert proc.stdout is not None
    return Ranks(folder, proc, _LogPump(proc.stdout))


def _adopt_log(folder: Path, rd: RunDir) -> None:
    """From the go on, this supervisor prints into the run's supervisor.log, after what it
    printed in standby."""
    target = rd.logs_dir / SUPERVISOR_LOG
    sys.stdout.flush()
    with target.open("ab") as out:
        out.write((folder / SUPERVISOR_LOG).read_bytes())
    fd = os.open(target, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> int:
    folder, nproc = Path(argv[0]), int(argv[1])
    me = procs.ProcessIdentity.me("supervisor")

    def discard(signum: int, frame: object) -> None:
        raise _Discarded

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, discard)
    ranks = _start_ranks(folder, nproc, me)
    try:
        line = sys.stdin.buffer.readline()
        if not line:  # refused, or the launching process died: nothing may go on
            print("standby: discarded before the go", flush=True)
            return 0
        from workbench.runs.rundir import RunDir
        from workbench.runs.supervise import supervise

        rd = RunDir(json.loads(line)["run_dir"])
        _adopt_log(folder, rd)
        print(f"standby: go for {rd.path}", flush=True)
        return supervise(str(rd.path), standby=ranks)
    except _Discarded:
        return 0
    finally:
        ranks.stop()


# -- a standby rank -----------------------------------------------------------------------------
def await_go(folder: str) -> str:
    """In a rank: import what training needs, then wait for the go; the run directory."""
    procs.watch_supervisor()  # a standby rank ends with its supervisor, too
    import torch

    import workbench.train.run  # noqa: F401
    from workbench.train import callbacks  # noqa: F401
    from workbench.train.preload import import_training_libraries, imports_done

    import_training_libraries()
    imports_done()  # before the wait: the collector is on again by the go

    go = Path(folder) / GO_FILE
    while not go.is_file():
        time.sleep(_POLL_S)
    order: dict[str, Any] = json.loads(go.read_text(encoding="utf-8"))
    os.environ.update(order["env"])
    leased = order["env"].get("CUDA_VISIBLE_DEVICES")
    # CUDA fixes its visible devices when first initialised: this first call sees the lease,
    # unless an import initialised CUDA before the go; only a fresh process sees it then.
    if leased is not None and torch.version.cuda and \
            torch._C._cuda_getDeviceCount() != len([d for d in leased.split(",") if d]):
        os.execv(sys.executable, [sys.executable, "-m", "workbench.train", order["run_dir"]])
    return str(order["run_dir"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
