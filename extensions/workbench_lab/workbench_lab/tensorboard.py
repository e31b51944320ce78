"""TensorBoard for one run: started on demand on loopback, one process per run, stopped with the server.

TensorBoard reads the run's ``tb/`` folder (written by the Trainer when ``tracking.tensorboard``
is on). The process listens on 127.0.0.1 only; the panel opens its URL in a new browser tab.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from workbench.errors import WorkbenchError


class TensorBoardError(WorkbenchError, RuntimeError):
    """TensorBoard could not be started for a run."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TensorBoards:
    """The TensorBoard processes this server started, by run id."""

    def __init__(self) -> None:
        self._procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def url(self, run_id: str, logdir: Path, wait_s: float = 30.0) -> str:
        running = self._procs.get(run_id)
        if running is not None and running[0].poll() is None:
            return running[1]
        if not logdir.is_dir():
            raise TensorBoardError(f"run {run_id} has no TensorBoard events yet ({logdir} is missing)")
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise TensorBoardError(f"TensorBoard exited with code {proc.returncode} for run {run_id}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                self._procs[run_id] = (proc, url)
                return url
            except OSError:
                time.sleep(0.3)
        proc.terminate()
        raise TensorBoardError(f"TensorBoard did not start within {wait_s:.0f} s for run {run_id}")

    def stop_all(self) -> None:
        for proc, _url in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, _url in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs.clear()
