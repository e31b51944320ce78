"""What a course allows: a student's RunSpec checked against the caps and priced by the course.

Whatever a student writes in ``budget`` is replaced: the course's currency and price table price
every run, and the limit is set later to the hold (:mod:`workbench.course.desk`). A spec over a cap
is refused with a :class:`~workbench.errors.CourseError` that says which cap and what to change.
An evaluation is priced the same way, on what ``workbench eval`` holds to score the run
(:func:`eval_price`).
"""

from __future__ import annotations

from typing import Any

from workbench.course.config import Course
from workbench.errors import CourseError
from workbench.spec import RunSpec


def priced_spec(course: Course, spec: RunSpec) -> RunSpec:
    """``spec`` with the course's prices in ``budget`` (no limit yet), or CourseError."""
    if spec.target not in course.targets:
        raise CourseError(f"target {spec.target!r} is not one of this course's targets "
                          f"({', '.join(course.targets)}); set target to one of them")
    r, caps = spec.resources, course.caps
    cards = r.gpus_per_node * r.nodes
    if cards > caps.gpus_per_run:
        raise CourseError(f"the run asks for {cards} GPUs; this course allows {caps.gpus_per_run} "
                          "per run: lower resources.gpus_per_node or resources.nodes")
    if cards == 0 and r.world_size > caps.processes_per_run:
        raise CourseError(f"the run asks for {r.world_size} CPU processes; this course allows "
                          f"{caps.processes_per_run} per run: set resources.processes_per_node")
    budget: dict[str, Any] = {"currency": course.currency, "limit": None,
                              "price_per_cpu_core_hour": course.prices.cpu_core_hour,
                              "price_per_gpu_hour": None}
    if cards:
        gpu = r.gpu_type or ""
        price = course.prices.gpu_hour.get(gpu, course.prices.default_gpu_hour)
        if price is None:
            listed = ", ".join(course.prices.gpu_hour) or "none"
            raise CourseError(f"this course has no price for GPU type {gpu or '(unset)'!r} "
                              f"(priced: {listed}); set resources.gpu_type to a priced one")
        budget["price_per_gpu_hour"] = price
    data = spec.model_dump(mode="json")
    data["budget"] = budget
    return RunSpec.parse(data)


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
    cards), else one CPU core. Priced by the course's table through the bill's own formula
    (:func:`workbench.budget.hourly_price`), as a launch is planned."""
    from workbench.budget import hourly_price

    one = spec.updated(**{"resources.nodes": 1, "resources.processes_per_node": 1})
    priced = priced_spec(course, one)
    price, _ = hourly_price(priced)
    r = priced.resources
    what = (f"{r.gpus_per_node} x {r.gpu_type or 'GPU'} on {priced.target}" if r.gpus_per_node
            else f"one CPU core on {priced.target}")
    return price, what
