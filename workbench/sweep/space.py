"""The search space of a sweep: dotted RunSpec paths mapped to the values a trial may take.

    >>> space = parse_space({"train.lr": [1e-4, 3e-4], "method.lora_r": {"low": 4, "high": 16}})
    >>> [p.path for p in space]
    ['train.lr', 'method.lora_r']

A parameter is a list of choices (any strategy) or a range ``{"low", "high", "log", "step"}``
(random and optuna; grid only with an integer ``step``, which expands it into choices). Every path
and every value is checked against the RunSpec before anything starts: a trial whose spec would
be refused is refused here, with the field named and the fix said (:class:`SweepError`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from workbench.errors import SpecError, SweepError
from workbench.spec import RunSpec
from workbench.spec.problems import FAMILIAR

Choice = bool | int | float | str | None
# What a sweep sets itself: a trial's name and budget belong to the sweep, not to the space.
_RESERVED = {"name", "budget.limit", "target"}


@dataclass(frozen=True)
class Param:
    """One swept field: ``choices`` (a list) or a numeric range ``low..high``."""

    path: str
    choices: tuple[Choice, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None

    @property
    def is_int(self) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool)
                   for v in (self.low, self.high, self.step) if v is not None)

    def grid_values(self) -> list[Choice]:
        if self.choices is not None:
            return list(self.choices)
        if self.step is None or not self.is_int:
            raise SweepError(
                f"space[{self.path!r}] is a continuous range: a grid needs a list of values, or "
                f"an integer range with a step, e.g. {{'low': 4, 'high': 16, 'step': 4}}; or use "
                f"strategy='random' or 'optuna'")
        assert self.low is not None and self.high is not None
        return list(range(int(self.low), int(self.high) + 1, int(self.step)))

    def to_dict(self) -> Any:
        if self.choices is not None:
            return list(self.choices)
        out: dict[str, Any] = {"low": self.low, "high": self.high}
        if self.log:
            out["log"] = True
        if self.step is not None:
            out["step"] = self.step
        return out


def _check_path(path: str, base: RunSpec) -> None:
    if path in _RESERVED:
        instead = {"budget.limit": "budget=", "target": "target="}.get(path, "a spec name")
        raise SweepError(f"space[{path!r}]: a sweep sets {path} itself; give the sweep "
                         f"{instead} instead")
    node: Any = base.model_dump(mode="json")
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            options = sorted(node) if isinstance(node, dict) else []
            familiar = FAMILIAR.get(part, "")  # learning_rate -> lr, as the spec's errors say
            close = [familiar] if familiar in options else difflib.get_close_matches(
                part, options, n=1, cutoff=0.5)
            where = ".".join(walked) or "the spec"
            hint = f"did you mean {'.'.join([*walked, close[0]])!r}? " if close else ""
            raise SweepError(
                f"space[{path!r}]: {where} has no field {part!r}; {hint}fields there: "
                f"{', '.join(options) or '(none: it is a value)'}")
        walked.append(part)
        node = node[part]
    if isinstance(node, dict):
        raise SweepError(f"space[{path!r}] is a whole section; sweep one of its fields, e.g. "
                         f"{path}.{next(iter(node), 'FIELD')}")


def _check_value(path: str, value: Any, base: RunSpec) -> None:
    try:
        base.updated(**{path: value})
    except SpecError as exc:
        why = "; ".join(msg for _, msg in exc.problems)
        raise SweepError(f"space[{path!r}]: the value {value!r} is refused by the spec: {why}. "
                         f"Remove it from the space or fix it") from None


def _param(path: str, raw: Any) -> Param:
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise SweepError(f"space[{path!r}] is an empty list; give at least one value")
        bad = [v for v in raw if v is not None and not isinstance(v, (bool, int, float, str))]
        if bad:
            raise SweepError(f"space[{path!r}]: choices must be numbers, strings, booleans or "
                             f"None (got {bad[0]!r}); sweep a scalar field")
        return Param(path, choices=tuple(raw))
    if isinstance(raw, dict):
        unknown = set(raw) - {"low", "high", "log", "step"}
        if unknown or not {"low", "high"} <= set(raw):
            raise SweepError(f"space[{path!r}]: a range is {{'low': A, 'high': B}} with optional "
                             f"'log' and 'step'; got keys {sorted(raw)}")
        low, high = raw["low"], raw["high"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
            raise SweepError(f"space[{path!r}]: low and high must be numbers")
        if low >= high:
            raise SweepError(f"space[{path!r}]: low ({low}) must be below high ({high})")
        if raw.get("log") and low <= 0:
            raise SweepError(f"space[{path!r}]: a log range needs low > 0 (got {low})")
        return Param(path, low=low, high=high, log=bool(raw.get("log")), step=raw.get("step"))
    raise SweepError(f"space[{path!r}]: give a list of values or a range {{'low': A, 'high': B}}, "
                     f"not {type(raw).__name__}")


def parse_space(space: Any, base: RunSpec | None = None) -> list[Param]:
    """Validate ``space`` against ``base`` (the sweep's RunSpec) and return its parameters."""
    base = base or RunSpec()
    if not isinstance(space, dict) or not space:
        raise SweepError("the sweep's space is empty: give at least one dotted RunSpec field and "
                         "its values, e.g. space={'train.lr': [1e-4, 3e-4, 1e-3]}")
    params = []
    for path, raw in space.items():
        if not isinstance(path, str):
            raise SweepError(f"space keys are dotted RunSpec paths like 'train.lr', not {path!r}")
        _check_path(path, base)
        param = _param(path, raw)
        for value in param.choices if param.choices is not None else (param.low, param.high):
            if param.choices is None and param.is_int:
                value = int(value)  # type: ignore[arg-type]
            _check_value(path, value, base)
        params.append(param)
    return params


def grid_size(params: list[Param]) -> int:
    n = 1
    for p in params:
        n *= len(p.grid_values())
    return n


def trial_spec(base: RunSpec, params: dict[str, Any]) -> RunSpec:
    """The trial's RunSpec: the sweep's spec with this trial's values set."""
    return base.updated(**params)
