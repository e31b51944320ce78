"""A real JupyterLab server for the lab tests: started once per session (the browser tests and the
REST tests share it; each start cost the suite seconds), on loopback with a token.

The server gets the session's WORKBENCH_HOME (from tests/conftest.py), serves files from that
folder (so run folders open in the file browser), keeps its config, runtime and user settings in
a temp folder, reads its app settings from the folder the extension ships (news and update checks
off), and is stopped by PID.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import requests

from tests import waiting

ARTIFACTS = Path(__file__).parent / "artifacts"


@dataclass
class LabServer:
    url: str
    token: str
    root: Path
    log: Path

    def api(self, path: str) -> str:
        return f"{self.url}/workbench/api/{path}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shipped_lab_settings() -> Path:
    """The folder the extension installs as JupyterLab's app settings (share/jupyter/lab/settings).

    The servers here read their settings from it, so the tests see what a user of ``make lab``
    sees (news and update checks off) and not a setting only the tests write.
    """
    ext = Path(__file__).parents[2] / "extensions" / "workbench_lab"
    # The wheel's shared-data line (tomllib is 3.11+; this line is all we need of the file).
    (source,) = re.findall(r'^"([^"]+)" = "share/jupyter/lab/settings"$',
                           (ext / "pyproject.toml").read_text(), re.MULTILINE)
    return ext / source


@pytest.fixture(scope="session")
def lab_server(wb_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    with running_lab(wb_home, tmp_path_factory.mktemp("jupyter-state")) as server:
        yield server


@contextmanager
def running_lab(root: Path, state: Path, log_name: str = "jupyter-server.log",
                env: dict[str, str] | None = None) -> Iterator[LabServer]:
    """JupyterLab serving ``root``, its own folders under ``state``, ``env`` added to ours."""
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / log_name
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(state / "config"),
           "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(state / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"), **(env or {})}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           f"--LabApp.app_settings_dir={shipped_lab_settings()}",
           "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
           "--ServerApp.terminals_enabled=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True)
    server = LabServer(f"http://127.0.0.1:{port}", token, root, log)
    try:
        deadline = time.time() + 180  # a deadline only: the loop ends as soon as it answers
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{server.url}/api/status", headers=server.auth, timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                pytest.fail(f"jupyter lab did not answer in 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The suite's one poll loop (tests/waiting.py), at the half-second these browser and server
# checks have always polled at (each poll may be a page query or an HTTP round trip).
wait_for = partial(waiting.wait_for, every=0.5)
