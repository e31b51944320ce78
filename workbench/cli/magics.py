"""IPython magics: ``%workbench COMMAND ...`` runs the CLI command in the kernel and returns its
result (a Job displays as its summary); ``%%runspec [NAME]`` turns a YAML cell into a RunSpec;
``%workbench_form`` shows the run form.

    %load_ext workbench
    %workbench status
"""

from __future__ import annotations

import shlex
from typing import Any

from workbench.errors import WorkbenchError


def register(ipython: Any) -> None:
    def workbench_magic(line: str) -> Any:
        from workbench.cli import run

        try:
            result = run(shlex.split(line))
        except WorkbenchError as exc:
            print(f"error: {exc}")
            return None
        except SystemExit:  # argparse already printed the usage message
            return None
        if isinstance(result, str):
            if result:
                print(result)
            return None
        return result

    def runspec_magic(line: str, cell: str) -> Any:
        from workbench.spec import RunSpec

        name = line.strip() or "spec"
        try:
            spec = RunSpec.from_yaml(cell)
        except WorkbenchError as exc:
            print(f"error: {exc}")
            return None
        ipython.user_ns[name] = spec
        print(f"{name} = RunSpec(name={spec.name!r}, model={spec.model.id!r}, "
              f"method={spec.method.kind!r}, target={spec.target!r})")
        return None

    def form_magic(line: str) -> Any:
        from workbench.widgets import RunForm

        return RunForm(ipython.user_ns.get(line.strip())) if line.strip() else RunForm()

    ipython.register_magic_function(workbench_magic, "line", "workbench")
    ipython.register_magic_function(runspec_magic, "cell", "runspec")
    ipython.register_magic_function(form_magic, "line", "workbench_form")
