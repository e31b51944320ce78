"""Run a notebook headless (``workbench demo``), printing each cell's output as it finishes.

A terminal cannot show a plot, so each image a cell displays is saved as a PNG file and its
path printed in its place; widgets (live views, progress bars) have no terminal form and are
left out. The notebook runs on the kernel it declares ("Python (Workbench)" for ours).
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _print_output(out: dict[str, Any], figure: Path) -> None:
    data = out.get("data", {})
    if out.get("output_type") == "stream":
        text = out.get("text") or ""
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    elif out.get("output_type") not in ("execute_result", "display_data") or WIDGET_MIME in data:
        return
    elif "image/png" in data:
        figure.parent.mkdir(parents=True, exist_ok=True)
        figure.write_bytes(base64.b64decode(data["image/png"]))
        print(f"plot saved to {figure}")
    elif data.get("text/plain"):
        print(data["text/plain"])


def _kernel_name(nb: Any, path: Path) -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    name = str(nb.metadata.get("kernelspec", {}).get("name") or "python3")
    if name not in KernelSpecManager().find_kernel_specs():
        raise WorkbenchError(
            f"{path.name} runs on the {name!r} kernel, which is not installed here; install it "
            f"with `jupyter kernelspec install --sys-prefix --name {name} kernels/{name}` "
            "(`make setup` does)")
    return name


def run_notebook(path: str | Path, timeout: int = 900, figures: str | Path | None = None) -> None:
    """Execute ``path``; images go to ``figures`` (default: WORKBENCH_HOME/demo) as PNG files."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from jupyter_core.paths import jupyter_runtime_dir
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from workbench.runs.home import home

    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"notebook {path} not found; run from the repository root")
    nb = nbformat.read(path, as_version=4)
    out_dir = Path(figures) if figures is not None else home() / "demo"

    class _Printing(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):  # type: ignore[override]
            result = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            images = 0
            for out in cell.get("outputs", []):
                images += "image/png" in out.get("data", {})
                _print_output(out, out_dir / f"{path.stem}-cell{cell_index}-{images}.png")
            sys.stdout.flush()
            return result

    # IPC (local sockets only) spares the terminal ipykernel's "running over TCP without
    # encryption" warning. An absolute socket path: the kernel runs in the notebook's folder.
    runtime = Path(jupyter_runtime_dir())
    runtime.mkdir(parents=True, exist_ok=True)
    sockets = runtime / f"workbench-demo-{os.getpid()}"
    km = KernelManager(kernel_name=_kernel_name(nb, path), transport="ipc", ip=str(sockets))
    client = _Printing(nb, km=km, timeout=timeout,
                       resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        raise WorkbenchError(f"{path.name} failed:\n{exc}") from None
    finally:  # a kernel manager passed in is ours to stop, and it leaves its sockets behind
        if km.has_kernel:
            km.shutdown_kernel()
        for leftover in runtime.glob(f"{sockets.name}-*"):
            leftover.unlink(missing_ok=True)
