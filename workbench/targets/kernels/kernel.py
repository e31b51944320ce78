"""The "Python (Workbench)" kernel: ipykernel with the workbench magics loaded and widgets imported.

``kernels/workbench/kernel.json`` starts ``python -m workbench.targets.kernels.kernel -f CONNECTION_FILE``;
every ipykernel option still works on that command line. In the kernel, ``%workbench status``,
``%%runspec`` and ``%workbench_form`` work at once, and ``workbench``, ``RunSpec`` and ``RunForm``
are already imported.
"""

from __future__ import annotations

STARTUP_LINES = [
    "import workbench",
    "from workbench import RunSpec",
    "from workbench.widgets import RunForm",
]


def main(argv: list[str] | None = None) -> None:
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(argv=argv, extensions=["workbench"], exec_lines=STARTUP_LINES)


if __name__ == "__main__":
    main()
