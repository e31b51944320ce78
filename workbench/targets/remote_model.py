"""Models that live on the target: a ``model.id`` folder that is not on this machine is checked
where the run loads it, not here.

:func:`check_on_target` runs a short script with the target's Python and environment on each
host that loads the model (SSH: every node, as each reads its own disk; Slurm: the login node,
which sees the cluster's shared filesystem as the compute nodes do). It reads the folder's
config.json and lists its tokenizer files there; a folder found nowhere is a
:class:`~workbench.errors.ModelNotFoundError` naming both places and what to do. Launch then plans
inside :func:`planned_from` (the planner's shape reader asks :func:`target_config` for the config
read on the target) and leaves tokenising to the ranks, which can load the tokenizer.

    >>> found = check_on_target(spec, get_backend(spec.target))  # doctest: +SKIP
    >>> found.where, found.path                                  # doctest: +SKIP
    ('host gpu1', '/scratch/me/models/llama-8b')
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import ModelNotFoundError
from workbench.spec import RunSpec
from workbench.targets.named import TargetError

# Any one of these lets AutoTokenizer load the folder's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# Runs on the target (argv: the model path; stdout: one JSON line). Plain python3 is enough: it
# reads config.json as JSON, which is also all the planner needs.
PROBE = r"""
import json, os, sys
p = os.path.expanduser(sys.argv[1])
out = {"path": os.path.abspath(p), "kind": "dir" if os.path.isdir(p) else
       "file" if os.path.exists(p) else "missing"}
if out["kind"] == "dir":
    try:
        with open(os.path.join(p, "config.json"), encoding="utf-8") as fh:
            out["config"] = json.load(fh)
        if not isinstance(out["config"], dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        out["config"] = None
        out["config_error"] = f"{type(exc).__name__}: {exc}"
    out["tokenizer"] = [n for n in sys.argv[2:] if os.path.isfile(os.path.join(p, n))]
print("WORKBENCH-MODEL " + json.dumps(out))
"""


@dataclass(frozen=True)
class TargetModel:
    """A model folder as the target sees it: where it was read, and its config.json."""

    model_id: str
    where: str  # "host gpu1", "this machine" (a Slurm login node the notebook runs on)
    path: str  # the folder's absolute path there
    config: dict[str, Any]
    tokenizer_files: tuple[str, ...]


def lives_on_target(spec: RunSpec) -> bool:
    """Whether ``spec.model.id`` is a folder to look for on the target: the run goes to another
    machine and the path (absolute or ``~/``) does not exist here. A relative path that does
    not exist here is refused: it would name a different folder on each machine."""
    from workbench.spec.models import is_absolute_folder_id, is_builtin, resolve_model

    model_id = spec.model.id
    if spec.target == "local" or is_builtin(model_id) or \
            Path(os.path.expanduser(model_id)).exists():
        return False
    if is_absolute_folder_id(model_id):
        return True
    try:
        resolve_model(model_id)  # a hub id stays one
    except ModelNotFoundError:
        raise ModelNotFoundError(
            f"model {model_id!r} is not a folder on this machine, and a relative path would "
            f"name a different folder on {spec.target}; give the folder's absolute path on the "
            "target (or ~/...), a hub id (ORG/NAME) or a built-in (builtin:tiny-llama)") from None
    return False


def check_on_target(spec: RunSpec, backend: Any) -> TargetModel:
    """Read ``spec.model.id``'s config.json on each host that loads it (``backend.shells``);
    raise ModelNotFoundError when a host lacks the folder, its config.json or its tokenizer."""
    model_id = spec.model.id
    found: list[TargetModel] = []
    missing: list[str] = []
    for transport, prefix in backend.shells(spec):
        answer = _probe(transport, prefix, backend.target.python, model_id, spec.target)
        where, path = transport.where, answer["path"]
        if answer["kind"] == "missing":
            missing.append(f"{where} ({path})")
            continue
        if answer["kind"] != "dir":
            raise ModelNotFoundError(
                f"model.id {model_id!r} is a file on {where} ({path}), not a model folder; point "
                "model.id at the folder saved with save_pretrained")
        if answer.get("config") is None:
            raise ModelNotFoundError(
                f"model folder {path} on {where} has no readable config.json "
                f"({answer.get('config_error')}); point model.id at a folder saved with "
                "save_pretrained (config.json, weights, tokenizer files), readable by the "
                f"target's user")
        if not answer["tokenizer"]:
            raise ModelNotFoundError(
                f"model folder {path} on {where} has no tokenizer (none of "
                f"{', '.join(TOKENIZER_FILES)}); the run tokenises its data there, so save the "
                f"tokenizer into it: tokenizer.save_pretrained({path!r})")
        found.append(TargetModel(model_id, where, path, answer["config"],
                                 tuple(answer["tokenizer"])))
    here = os.path.abspath(os.path.expanduser(model_id))
    if missing and not found:
        raise ModelNotFoundError(
            f"model folder {model_id!r} exists neither on this machine ({here}) nor on "
            f"{' nor '.join(missing)}; copy the model folder (config.json, weights, tokenizer) to "
            f"that path on {spec.target}'s host(s), or fix model.id (a folder that exists, a "
            "hub id ORG/NAME, or builtin:tiny-llama)")
    if missing:
        raise ModelNotFoundError(
            f"model folder {model_id!r} is on {found[0].where} ({found[0].path}) but not on "
            f"{', '.join(missing)}: every node loads the model from its own disk; copy the folder "
            "there too (or to a folder all hosts share, and point model.id at it)")
    return found[0]


def _probe(transport: Any, prefix: str, python: str, model_id: str,
           target: str) -> dict[str, Any]:
    cmd = (f"{prefix}{shlex.quote(python)} - {shlex.quote(model_id)} "
           + " ".join(shlex.quote(n) for n in TOKENIZER_FILES))
    res = transport.run(cmd, input=PROBE.encode(), check=False, timeout=120)
    line = next((ln for ln in res.stdout.decode(errors="replace").splitlines()
                 if ln.startswith("WORKBENCH-MODEL ")), None)
    if res.returncode != 0 or line is None:
        raise TargetError(
            f"could not look for model folder {model_id!r} on {transport.where}: "
            f"{res.text[-1500:] or 'no output'}\n-> `workbench targets check {target}` says "
            "what is missing there")
    answer: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    return answer


# The config read on the target for the model id being planned: set by launch around its plan.
_PLANNED: contextvars.ContextVar[TargetModel | None] = contextvars.ContextVar(
    "workbench_target_model", default=None)


@contextlib.contextmanager
def planned_from(found: TargetModel) -> Iterator[None]:
    """Plan inside this block from ``found``'s config (see :func:`target_config`). The planner
    caches shapes by model id: clear its cache around the block (launch does), since the same
    path may hold another model on another target."""
    token = _PLANNED.set(found)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def target_config(model_id: str) -> TargetModel | None:
    """The folder read on the target for ``model_id`` while it is planned, else None."""
    found = _PLANNED.get()
    return found if found is not None and found.model_id == model_id else None
