"""Typed errors. Every message says what went wrong *and* what to do next.

All errors derive from :class:`WorkbenchError`, so a notebook can catch one type; each front end
(widgets, CLI, magics, the lab panel) shows ``str(error)`` as it is. They live here, not beside the
code that raises them, so that any module can raise or catch one without importing another room
(the registry raises ``EndpointNotFoundError`` without importing ``workbench.serve``).
"""

from __future__ import annotations

from collections.abc import Callable


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class SpecError(WorkbenchError, ValueError):
    """A RunSpec (or a YAML file holding one) is invalid.

    ``problems`` holds one ``(field_path, message)`` pair per problem, e.g.
    ``("train.lr", "must be greater than 0")``.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid run spec{where}:"]
        lines += [f"  {path or '<root>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class ModelNotFoundError(WorkbenchError, FileNotFoundError):
    """The model id is neither a built-in, an existing folder, nor reachable on the hub."""


class DatasetError(WorkbenchError, ValueError):
    """A dataset source cannot be used (missing, unreadable, empty)."""


class DatasetFormatError(DatasetError):
    """A row of a dataset does not have the fields its format needs."""


class ImageDataError(DatasetFormatError):
    """An image a row names is missing, unreadable or not an image, or a row's images and its
    image marks do not match; the message names the row and the file and says what to do."""


class EmptyDatasetError(DatasetError):
    """A dataset (or what is left of it after cleaning or splitting) has no rows."""


class DataTruncationError(DatasetError):
    """Truncation to data.max_length would leave too few examples with anything to train on."""


class DataTruncationWarning(UserWarning):
    """Truncation to data.max_length cuts more than a few training examples (the run still
    trains on what is left); the message says how many, how much and what to change."""


class ResourceError(WorkbenchError, RuntimeError):
    """The requested resources (GPUs, processes) are not available on the target."""


class RunNotFoundError(WorkbenchError, LookupError):
    """No run in the registry matches the given id or name."""


class LaunchError(WorkbenchError, RuntimeError):
    """The backend could not start the run."""


class JobFailedError(WorkbenchError, RuntimeError):
    """Raised by ``Job.wait(raise_on_failure=True)`` when the run ended badly."""


class TargetError(LaunchError):
    """A target is unknown, misconfigured, unreachable, or refused the run (says what to do)."""


class SetupError(TargetError):
    """``workbench targets setup`` could not be done; one line that says what to do. Nothing was
    recorded."""


class PlanError(WorkbenchError, RuntimeError):
    """A run cannot fit (or cannot be planned). The message says why and what to change."""


# -- serving (workbench.serve) ---------------------------------------------------------------------
class DeployError(WorkbenchError, RuntimeError):
    """An endpoint could not be deployed; the message says why and what to do."""


class AdapterNotFoundError(DeployError, FileNotFoundError):
    """The adapter (or model) folder to serve does not exist or is not a peft adapter."""


class LoraRankError(DeployError, ValueError):
    """An adapter's LoRA rank is above what the server accepts (``max_lora_rank``)."""


class PortInUseError(DeployError, OSError):
    """The requested port is already bound on the target."""


class ServingEnvironmentError(DeployError):
    """The serving Python does not exist or has no vLLM."""


class UnsupportedModelError(DeployError, ValueError):
    """The model cannot be served by this backend (e.g. a head size vLLM's CPU backend lacks)."""


class EndpointStartError(DeployError):
    """The server started but died or never became healthy; the message holds its log tail."""


class EndpointNotFoundError(WorkbenchError, LookupError):
    """No endpoint in the registry has that name."""


class EndpointReplacedError(EndpointNotFoundError):
    """An endpoint handle's own deployment is gone and its name now belongs to a newer one; the
    handle changes nothing (``workbench.serve.get_endpoint(NAME)`` gives the current endpoint)."""


class BudgetError(WorkbenchError, ValueError):
    """A budget limit that could not be kept: no price, another currency, or already spent."""


class ExportError(WorkbenchError):
    """An export (workbench.serve.export_run) that cannot be done, or whose result did not load
    or answer as the model does: nothing half-written is left presented as done."""


class CreditError(BudgetError):
    """The wallet (workbench.runs.wallet) cannot cover what was asked, or was asked wrongly:
    nothing was started."""


class RunBusyError(WorkbenchError, RuntimeError):
    """A run still has live processes (or another resume is starting it): it cannot start again."""


class RemoteKernelError(WorkbenchError, RuntimeError):
    """A remote kernel could not start, or was lost (host unreachable, no ipykernel there, a Slurm
    allocation that did not start in time, a dropped connection); the message says what to do."""


class SweepError(WorkbenchError, ValueError):
    """A sweep cannot be started or resumed as asked (bad space, objective, budget or strategy)."""


class SweepNotFoundError(WorkbenchError, LookupError):
    """No sweep under WORKBENCH_HOME/sweeps matches the given id or name."""


# -- course mode (workbench.course) ----------------------------------------------------------------
class CourseError(WorkbenchError, RuntimeError):
    """A course request was refused: not allowed, over a cap, or the course file is wrong."""


class CourseSpecError(CourseError):
    """A student's spec names what the course does not allow: one ``(field_path, message)`` pair
    per refused field in ``problems``, each message saying what the course allows."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = ["the course does not allow this spec:"]
        lines += [f"  {path}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class InsufficientCreditError(CourseError):
    """A run's hold would take a student's credit below zero: nothing was started."""

    def __init__(self, student: str, needed: int, balance: int,
                 money: Callable[[int], str] = "{} minor units".format) -> None:
        self.student, self.needed, self.balance = student, needed, balance
        super().__init__(
            f"{student} has {money(balance)} of credit left but this run needs a hold of "
            f"{money(needed)}: "
            "nothing was started. Make the run smaller (fewer steps, fewer processes), or ask an "
            "instructor for a grant")


# -- preference and reward tuning (workbench.data.preference, workbench.train.rewards) ----------
class PreferenceDataError(DatasetFormatError):
    """Preference data that cannot train its stage: a missing field, chosen equal to rejected,
    or a format that does not fit method.stage (e.g. SFT demonstrations for DPO)."""


class RewardError(WorkbenchError, ValueError):
    """A GRPO reward cannot be used: its module or function is missing, not callable, or has a
    signature TRL cannot call, or its reference column is not in the data."""


# -- evaluation (workbench.evaluate) ---------------------------------------------------------------
class EvalError(WorkbenchError, RuntimeError):
    """An evaluation could not run; the run itself (weights, metrics, eval.jsonl) is untouched."""


class EvalTaskError(EvalError, ValueError):
    """An eval task is unknown (no such lm-eval task) or its file lacks a field it needs."""


class JudgeError(EvalError):
    """The judge endpoint is unreachable or refused the request (key, model name, URL)."""


class FastPathError(WorkbenchError, ValueError):
    """A training fast path set ``on`` in ``train.fast`` cannot work where the run trains."""


class RemoteEvalError(EvalError):
    """A run on this remote target cannot be scored from here; the message says what to run."""
