"""workbench_lab: the Workbench side panel for JupyterLab and the REST endpoints behind it.

The server half (:mod:`workbench_lab.handlers`) adapts HTTP to the workbench library's own calls
(``workbench.jobs()``, ``Job.summary()``, ``Job.cancel()`` ...), so the panel, the kernel helpers
and the CLI share one implementation. The TypeScript half lives in ``src/`` and is shipped as a
prebuilt labextension.
"""

from __future__ import annotations

from typing import Any

try:
    from workbench_lab._version import __version__
except ImportError:  # a source checkout that was never built
    __version__ = "0.0.0"

__all__ = ["__version__"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "workbench-lab"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "workbench_lab"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    from workbench_lab.handlers import setup_handlers

    setup_handlers(server_app)
    server_app.log.info("workbench_lab: Workbench REST endpoints at /workbench/api")
