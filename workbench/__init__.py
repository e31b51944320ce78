"""Workbench: fine-tune language models from a notebook.

    >>> import workbench
    >>> job = workbench.launch(workbench.RunSpec(train={"max_steps": 20}))  # doctest: +SKIP
    >>> job.show()                                                         # doctest: +SKIP

One config object (:class:`RunSpec`), one run directory, one registry, one launch path
(:func:`launch`); widgets, magics, the CLI and the lab panel are thin views over these calls.
"""

import sys
import types

from workbench._version import __version__
from workbench.errors import (
    DatasetError,
    DatasetFormatError,
    EmptyDatasetError,
    JobFailedError,
    LaunchError,
    ModelNotFoundError,
    ResourceError,
    RunNotFoundError,
    SpecError,
    WorkbenchError,
)

# The rest loads on first use (PEP 562): the processes workbench starts (the supervisor, the
# serving guard) import only the modules they need, which saves ~0.4 s of pydantic and friends
# on every launch and deploy.
_LAZY = {"Job": "workbench.runs.jobs", "get_job": "workbench.runs.jobs", "jobs": "workbench.runs.jobs",
         "compare": "workbench.widgets.compare",
         "launch": "workbench.runs.launching", "plan": "workbench.plan", "deploy": "workbench.serve",
         "RunSpec": "workbench.spec", "sweep": "workbench.sweep", "get_sweep": "workbench.sweep",
         "sweeps": "workbench.sweep", "evaluate": "workbench.evaluate.runner",
         "credit": "workbench.runs.credit"}

from workbench.train.quiet import install as _quiet  # noqa: E402

_quiet()  # known library noise off (DeepSpeed's CPU notice, ...): see workbench.train.quiet

__all__ = [
    "DatasetError",
    "DatasetFormatError",
    "EmptyDatasetError",
    "Job",
    "JobFailedError",
    "LaunchError",
    "ModelNotFoundError",
    "ResourceError",
    "RunNotFoundError",
    "RunSpec",
    "SpecError",
    "WorkbenchError",
    "__version__",
    "compare",
    "credit",
    "deploy",
    "evaluate",
    "get_job",
    "get_sweep",
    "jobs",
    "launch",
    "load_ipython_extension",
    "plan",
    "sweep",
]


def load_ipython_extension(ipython):  # %load_ext workbench
    from workbench.cli.magics import register
    from workbench.cli.tracebacks import install

    register(ipython)
    install(ipython)


def _in_a_shell() -> None:
    """In IPython (a notebook kernel, the terminal shell), a Workbench error shows as its message
    (workbench.cli.tracebacks); nothing is imported when no shell runs."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and hasattr(shell, "set_custom_exc"):
        from workbench.cli.tracebacks import install

        install(shell)


_in_a_shell()


def __getattr__(name: str):  # PEP 562: workbench.launch, workbench.serve, ... on first use
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        try:
            value = importlib.import_module(f"workbench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"workbench.{name}":
                raise
            raise AttributeError(f"module 'workbench' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``workbench.plan`` and ``workbench.sweep`` are functions that share their subpackage's
    name.

    Loading a subpackage sets it as an attribute of its parent; here that must not replace the
    function of the same name.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
