"""TensorBoard for one run: started on demand on loopback, one process per run, stopped with the server.

TensorBoard reads the run's ``tb/`` folder (written by the Trainer when ``tracking.tensorboard``
is on). The process listens on 127.0.0.1 only, under the path prefix
``BASE_URL/workbench/tensorboard/RUN_ID``; the browser reaches it through the Jupyter server
(``TensorBoardProxyHandler`` in handlers.py), so it works wherever Jupyter itself is reached
(JupyterHub, an SSH tunnel to the notebook, HTTPS) and only for users Jupyter has let in.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from jupyter_server.utils import url_path_join

from workbench.errors import WorkbenchError


class TensorBoardError(WorkbenchError, RuntimeError):
    """TensorBoard could not be started for a run."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TensorBoards:
    """The TensorBoard processes this server started, by run id."""

    def __init__(self, base_url: str = "/") -> None:
        self.base_url = base_url
        self._procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}

    def prefix(self, run_id: str) -> str:
        """The path of a run's TensorBoard on the Jupyter server (no trailing slash)."""
        return url_path_join(self.base_url, "workbench", "tensorboard", run_id)

    def port(self, run_id: str) -> int | None:
        """The loopback port of a run's running TensorBoard, or None."""
        running = self._procs.get(run_id)
        return running[1] if running is not None and running[0].poll() is None else None

    def url(self, run_id: str, logdir: Path, wait_s: float = 30.0) -> str:
        """Start (or reuse) the run's TensorBoard; its path on the Jupyter server."""
        if self.port(run_id) is not None:
            return self.prefix(run_id) + "/"
        if not logdir.is_dir():
            raise TensorBoardError(f"run {run_id} has no TensorBoard events yet ({logdir} is missing)")
        # The port is free when chosen, but another process may take it before TensorBoard
        # binds it: TensorBoard then exits, and a connect would reach the other process. Only
        # TensorBoard's own answer under our prefix counts; a taken port means another port.
        for _attempt in range(3):
            port = _free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                 "--host", "127.0.0.1", "--port", str(port), "--path_prefix",
                 self.prefix(run_id)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
            if self._answers(proc, port, run_id, wait_s):
                self._procs[run_id] = (proc, port)
                return self.prefix(run_id) + "/"
            if proc.poll() is None:  # alive but silent for wait_s: not a port problem
                proc.terminate()
                raise TensorBoardError(
                    f"TensorBoard did not start within {wait_s:.0f} s for run {run_id}")
        raise TensorBoardError(
            f"TensorBoard exited with code {proc.returncode} for run {run_id} three times (last "
            f"on port {port}); check that `{sys.executable} -m tensorboard.main --logdir "
            f"{logdir}` starts")

    def _answers(self, proc: subprocess.Popen[bytes], port: int, run_id: str,
                 wait_s: float) -> bool:
        """True once TensorBoard answers under the run's prefix; False if it exited first."""
        import urllib.error
        import urllib.request

        url = f"http://127.0.0.1:{port}{self.prefix(run_id)}/"
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200 and proc.poll() is None:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        return False

    def stop_all(self) -> None:
        for proc, _port in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, _port in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs.clear()
