"""The notebooks the panel creates: "New fine-tuning run" (a short quickstart) and "Compare runs".

The cells follow ``notebooks/quickstart.ipynb`` (describe, check the plan, launch, watch), trimmed
to what a new run needs; the notebook opens on the "Python (Workbench)" kernel, where the
``%workbench`` magics are already loaded.
"""

from __future__ import annotations

import json
from typing import Any

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

KERNEL_NAME = "workbench"


def new_run_notebook(target: str = "local") -> dict[str, Any]:
    """A notebook (as JSON) that describes, plans, launches and watches one run on ``target``."""
    cells = [
        new_markdown_cell(
            "# New fine-tuning run\n\n"
            "Describe the run, check that it fits, launch it and watch the loss fall. The run also "
            "appears in the **Workbench** side panel (left), where you can cancel it or open its "
            "details."
        ),
        new_code_cell("import workbench\nfrom workbench.widgets import RunForm"),
        new_markdown_cell("## 1. Describe the run\n\nEvery section has defaults; change what you need."),
        new_code_cell(
            f'spec = workbench.RunSpec(name="my-run", target={json.dumps(target)},\n'
            '                          train={"epochs": 20, "lr": 3e-3})\n'
            "form = RunForm(spec)\nform"
        ),
        new_markdown_cell("## 2. Does it fit, and what does it cost?"),
        new_code_cell("workbench.plan(form.spec)"),
        new_markdown_cell("## 3. Launch and watch"),
        new_code_cell("job = workbench.launch(form.spec)\njob.show()"),
        new_code_cell("%workbench status"),
    ]
    return _notebook(cells)


def compare_notebook(run_ids: list[str]) -> dict[str, Any]:
    """A notebook (as JSON) whose first cell opens ``workbench.compare`` on the given runs."""
    runs = ", ".join(json.dumps(r) for r in run_ids)
    cells = [
        new_markdown_cell(
            "# Compare runs\n\nCurves overlaid (by step, tokens or time), final and best losses, "
            "eval scores and the spec keys that differ (yellow), and answers side by side. "
            "See docs/compare.md."
        ),
        new_code_cell(f"import workbench\n\nview = workbench.compare([{runs}])\nview"),
        new_code_cell("view.df  # the table as a DataFrame"),
    ]
    return _notebook(cells)


def _notebook(cells: list[Any]) -> dict[str, Any]:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": KERNEL_NAME, "display_name": "Python (Workbench)", "language": "python"},
        "language_info": {"name": "python"},
    })
    nbformat.validate(nb)
    return dict(nb)
