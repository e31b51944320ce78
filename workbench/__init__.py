"""Workbench: fine-tune language models from a notebook.

    >>> import workbench
    >>> job = workbench.launch(workbench.RunSpec(train={"max_steps": 20}))  # doctest: +SKIP
    >>> job.show()                                                         # doctest: +SKIP

One config object (:class:`RunSpec`), one run directory, one registry, one launch path
(:func:`launch`); widgets, magics, the CLI and the lab panel are thin views over these calls.
"""

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
from workbench.jobs import Job, get_job, jobs, launch
from workbench.plan import plan
from workbench.serve import deploy
from workbench.spec import RunSpec

__version__ = "0.1.0"

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
    "deploy",
    "get_job",
    "jobs",
    "launch",
    "load_ipython_extension",
    "plan",
]


def load_ipython_extension(ipython):  # %load_ext workbench
    from workbench.magics import register

    register(ipython)
