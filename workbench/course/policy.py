"""What a course allows: a student's spec admitted field by field, checked against the caps and
priced on the target's hardware.

The service never runs, imports or reads with its own rights what a student wrote, so
:func:`admit` refuses, with a :class:`~workbench.errors.CourseSpecError` that names each field and says
what the course allows, every field that would make a process run code or read a file the
student did not choose from the course: remote model code, an interpreter, reward modules, judge
URLs and key variables outside the course file's lists, files outside the student's own space,
and a spec given as a path. What is left runs as the student (:mod:`workbench.course.students`).

Whatever a student writes in ``budget`` is replaced: the course's currency and price table price
every run (the limit is set later to the hold, :mod:`workbench.course.desk`), on the GPU type of
the target (:func:`target_gpu_type`), never the student's word. An evaluation is priced the same
way, on what ``workbench eval`` holds to score the run (:func:`eval_price`).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Any

from workbench.course.config import Course
from workbench.errors import CourseError, CourseSpecError
from workbench.spec import BUILTIN_DATASET, BUILTIN_MODEL, RunSpec

BUILTIN_REWARDS = ("exact_match", "contains", "regex", "length")


def admit(course: Course, space: str, data: Any) -> RunSpec:
    """The student's spec (a mapping) as the course runs it: refused by field where it names
    code, a URL, a key or a file outside ``space`` (the student's own folder) that the course
    does not list; then capped and priced (:func:`priced_spec`)."""
    if not isinstance(data, dict):
        raise CourseError("give the spec as a mapping (a dict, or YAML read in your notebook); "
                          "the course service does not read paths or text from its own disk")
    spec = RunSpec.parse(data)
    refusals = list(_refusals(course, space, spec))
    if refusals:
        raise CourseSpecError(refusals)
    return priced_spec(course, spec)


def _inside(space: str, path: str) -> bool:
    """Whether ``path`` is an absolute path under ``space`` (a relative one could as well be a
    hub id), judged on the text alone: the student's own processes open it, with their own
    rights, so a link inside leads only where the student may go anyway."""
    if not path.startswith("/"):
        return False
    p = PurePosixPath(os.path.normpath(path))
    return PurePosixPath(space) in p.parents


def _refusals(course: Course, space: str, spec: RunSpec) -> Any:
    where = f"your folder {space} (an absolute path in it)"
    if spec.model.trust_remote_code:
        yield ("model.trust_remote_code", "a course runs no model code from a model folder; "
               "use a model of the course's list or a standard architecture")
    models = course.models or [BUILTIN_MODEL]
    if spec.model.id not in models and not _inside(space, spec.model.id):
        yield ("model.id", f"{spec.model.id!r} is neither one of the course's models "
               f"({', '.join(models)}) nor a folder in {where}")
    datasets = course.datasets or [BUILTIN_DATASET]
    for i, src in enumerate(spec.data.sources):
        if src.path not in datasets and not _inside(space, src.path):
            yield (f"data.sources.{i}.path", f"{src.path!r} is neither one of the course's "
                   f"datasets ({', '.join(datasets)}) nor a file in {where}")
    for i, r in enumerate(spec.method.rewards):
        if r.fn not in BUILTIN_REWARDS:
            yield (f"method.rewards.{i}.fn", f"a course allows the built-in rewards "
                   f"({', '.join(BUILTIN_REWARDS)}), not the module {r.fn!r}")
    for i, t in enumerate(spec.eval.tasks):
        if t.file is not None and not _inside(space, t.file):
            yield (f"eval.tasks.{i}.file", f"{t.file!r} is not a file in {where}")
        for name in t.tasks:
            if ("/" in name or name.endswith((".yaml", ".yml"))) and not _inside(space, name):
                yield (f"eval.tasks.{i}.tasks", f"{name!r} is not a task file in {where}")
        if t.judge is not None and t.judge not in course.judges:
            listed = ", ".join(course.judges) or "none"
            yield (f"eval.tasks.{i}.judge", f"{t.judge!r} is not one of the course's judges "
                   f"({listed})")
        if t.api_key_env is not None and t.api_key_env != course.judge_key_env:
            yield (f"eval.tasks.{i}.api_key_env", "a course's judge key is the course's own "
                   f"({course.judge_key_env or 'none is set'}); leave api_key_env out")
    if spec.serve.python is not None:
        yield ("serve.python", "the course serves with its own vLLM; leave serve.python out")
    storage = spec.checkpoint.storage
    if storage is not None and ("://" in storage or not _inside(space, storage)):
        yield ("checkpoint.storage", f"snapshots stay in the run's folder or in {where}; "
               "leave checkpoint.storage out")
    if spec.tracking.wandb == "online":
        yield ("tracking.wandb", "a course logs no run to an outside service; use offline "
               "(and `wandb sync` it yourself) or disabled")


def target_gpu_type(course: Course, target: str) -> str | None:
    """The GPU type a target's runs are priced at: the course file's ``hardware`` entry, else
    the card detected on the hub machine (local) or the type in the target's defaults; None
    when the target has none (its GPU runs are refused)."""
    if target in course.hardware:
        return course.hardware[target]
    if target == "local":
        from workbench.targets.gpus import detect_gpu_type

        return detect_gpu_type()
    from workbench.targets.named import get_target

    found = get_target(target).defaults.get("resources.gpu_type")
    return str(found) if found else None


def cards(spec: RunSpec) -> int:
    """Every card a run holds: its ranks' and, with ``eval.every_steps`` on GPUs, the spare one
    the evaluation beside it leases (workbench.evaluate.beside)."""
    r = spec.resources
    return r.gpus_per_node * r.nodes + (1 if r.gpus_per_node and spec.eval.every_steps else 0)


def priced_spec(course: Course, spec: RunSpec) -> RunSpec:
    """``spec`` with the course's prices in ``budget`` (no limit yet), or CourseError."""
    if spec.target not in course.targets:
        raise CourseError(f"target {spec.target!r} is not one of this course's targets "
                          f"({', '.join(course.targets)}); set target to one of them")
    if spec.target != "local":
        # The service meters a run from the processes it sees on the hub machine; a run on an
        # SSH host or a Slurm partition would be billed only the seconds its submission took.
        raise CourseError(f"target {spec.target!r}: a course's runs and sweeps run on the hub "
                          "machine (target: local), where the service meters them; other targets "
                          "serve endpoints (serve_target)")
    r, caps = spec.resources, course.caps
    held = cards(spec)
    if held > caps.gpus_per_run:
        beside = " (one of them for eval.every_steps)" if held > r.gpus_per_node * r.nodes else ""
        raise CourseError(f"the run asks for {held} GPUs{beside}; this course allows "
                          f"{caps.gpus_per_run} per run: lower resources.gpus_per_node or "
                          "resources.nodes")
    if held == 0 and r.world_size > caps.processes_per_run:
        raise CourseError(f"the run asks for {r.world_size} CPU processes; this course allows "
                          f"{caps.processes_per_run} per run: set resources.processes_per_node")
    budget: dict[str, Any] = {"currency": course.currency, "limit": None,
                              "price_per_cpu_core_hour": course.prices.cpu_core_hour,
                              "price_per_gpu_hour": None}
    data = spec.model_dump(mode="json")
    if held:
        gpu = target_gpu_type(course, spec.target)
        if gpu is None:
            raise CourseError(f"target {spec.target!r} has no GPU this course knows of; set "
                              "resources.gpus_per_node: 0 (or ask an instructor to name its "
                              "cards in the course file's hardware)")
        if r.gpu_type is not None and r.gpu_type != gpu:
            raise CourseError(f"resources.gpu_type {r.gpu_type!r}: the cards of {spec.target} "
                              f"are {gpu}; leave gpu_type out or set it to {gpu!r}")
        price = course.prices.gpu_hour.get(gpu, course.prices.default_gpu_hour)
        if price is None:
            listed = ", ".join(course.prices.gpu_hour) or "none"
            raise CourseError(f"this course has no price for GPU type {gpu!r} of "
                              f"{spec.target} (priced: {listed}); ask an instructor to price it")
        budget["price_per_gpu_hour"] = price
        data["resources"]["gpu_type"] = gpu
    data["budget"] = budget
    return RunSpec.parse(data)


def hourly_rate(spec: RunSpec) -> float:
    """What a priced run's resources cost an hour, every card it holds included (the service's
    meter bills this rate for the time it saw the attempt hold them)."""
    from workbench.runs.budget import hourly_price

    price, _ = hourly_price(spec)
    beside = cards(spec) - spec.resources.gpus_per_node * spec.resources.nodes
    return price + beside * float(spec.budget.price_per_gpu_hour or 0.0)


def check_plan(course: Course, plan: Any) -> float:
    """The planned cost of a priced spec, after the hours cap; CourseError when over it."""
    if plan.cost is None:
        raise CourseError("the planner could not price this run; ask an instructor to add its "
                          "resources to the course's price table")
    if plan.hours is not None and plan.hours > course.caps.hours_per_run:
        raise CourseError(f"the run is planned at {plan.hours:.2f} h; this course allows "
                          f"{course.caps.hours_per_run:g} h per run: train fewer steps")
    return float(plan.cost)


def eval_price(course: Course, spec: RunSpec) -> tuple[float, str]:
    """(price per hour, what it pays for) of scoring a run of ``spec`` where ``workbench eval``
    scores it: one process on one node of the run's target with the run's GPUs per node (a Slurm
    run's eval job asks its partition for them; an SSH or local run's process sees its host's
    cards), else one CPU core. Priced by the course's table, as a launch is."""
    one = spec.updated(**{"resources.nodes": 1, "resources.processes_per_node": 1,
                          "eval.every_steps": None})
    priced = priced_spec(course, one)
    r = priced.resources
    what = (f"{r.gpus_per_node} x {r.gpu_type or 'GPU'} on {priced.target}" if r.gpus_per_node
            else f"one CPU core on {priced.target}")
    return hourly_rate(priced), what
