"""Run a notebook headless (``workbench demo``), printing each cell's text output as it finishes."""

from __future__ import annotations

import sys
from pathlib import Path

from workbench.errors import WorkbenchError


def run_notebook(path: str | Path, timeout: int = 900) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"notebook {path} not found; run from the repository root")
    nb = nbformat.read(path, as_version=4)

    class _Printing(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):  # type: ignore[override]
            result = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain")
                if out.get("output_type") == "stream" and text:
                    sys.stdout.write(text if text.endswith("\n") else text + "\n")
                elif (text and out.get("output_type") in ("execute_result", "display_data")
                      and "application/vnd.jupyter.widget-view+json" not in out.get("data", {})):
                    print(text)
            sys.stdout.flush()
            return result

    client = _Printing(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        raise WorkbenchError(f"{path.name} failed:\n{exc}") from None
