"""What a course endpoint serves: planned as the student, served from copies the service took.

A student's run folder is the student's to write, links included, so the service opens none of
it with its own rights. The serving plan (which base, which adapters, the chat template) is made
by the worker, as the student (:mod:`workbench.course.worker`, request ``serve_plan``): whatever
the folder names that the student cannot read fails there. The service then checks the plan's
model is one of the course's models or a folder in the student's space, and copies each adapter
(and a student's model folder) into its own state folder, file by file, opening each without
following a link and keeping it only when it is a regular file the student owns
(:func:`copy_owned`). vLLM, started by the service, reads only those copies and the course's own
models, so a link to another student's files, the ledger or the service's home serves nothing
of theirs.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workbench.course.config import Course
from workbench.course.students import Worker, space
from workbench.errors import CourseError
from workbench.serve.sources import Adapter, ServePlan

MAX_FILE_BYTES = 64 << 30  # a shard of a student's model folder, at most


def plan_to_data(plan: ServePlan) -> dict[str, Any]:
    data = asdict(plan)
    data["adapters"] = [{**a, "path": str(a["path"])} for a in data["adapters"]]
    return data


def plan_from_data(data: dict[str, Any]) -> ServePlan:
    adapters = [Adapter(**{**a, "path": Path(a["path"])}) for a in data.get("adapters", [])]
    return ServePlan(**{**data, "adapters": adapters})


def student_plan(course: Course, student: str, runs: list[str]) -> ServePlan:
    """The serving plan of the student's runs (ids, or adapter folders), made by the worker as
    the student."""
    answer = Worker(course, student, {"verb": "serve_plan", "runs": runs}).answer(timeout=300)
    return plan_from_data(answer["plan"])


def copies(course: Course, student: str, plan: ServePlan, dest: Path) -> ServePlan:
    """``plan`` with every file of the student's it names copied into ``dest`` (the service's).
    An adapter's base is read from the service's copy of its config: one of the course's models
    is served from the service's own copy of it, a folder in the student's space is copied, and
    anything else is refused, as is remote code or a merge."""
    home = str(space(course, student))
    if plan.trust_remote_code:
        raise CourseError("a course endpoint runs no model code: model.trust_remote_code is "
                          "not allowed")
    if plan.merged:
        raise CourseError("a course endpoint serves the adapter on its base; merge is not "
                          "offered (deploy without merge)")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, mode=0o700)
    copied = []
    for i, a in enumerate(plan.adapters):
        if not _inside(home, str(a.path)):
            raise CourseError(f"adapter {a.name} is at {a.path}, outside your space")
        copied.append((a, copy_owned(a.path, dest / f"adapter-{i}", student)))
    bases = {_base_id(path) for _, path in copied} or {plan.model}
    if len(bases) > 1:
        raise CourseError(f"the runs were trained on different models ({', '.join(sorted(bases))});"
                          " deploy them one at a time")
    model = _served_model(course, student, bases.pop(), dest)
    adapters = [Adapter(a.name, path, model, a.rank, a.run_id) for a, path in copied]
    return ServePlan(**{**plan_to_data(plan), "model": model, "adapters": adapters})


def _base_id(adapter: Path) -> str:
    """The base an adapter was trained on, from the service's copy of its files."""
    import json

    def read(name: str) -> dict[str, Any]:
        try:
            data = json.loads((adapter / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    return str(read("workbench.json").get("base_model_id")
               or read("adapter_config.json").get("base_model_name_or_path") or "")


def _served_model(course: Course, student: str, model: str, dest: Path) -> str:
    from workbench.spec import BUILTIN_MODEL
    from workbench.spec.models import resolve_model

    home = str(space(course, student))
    allowed = course.models or [BUILTIN_MODEL]
    if model in allowed:
        return resolve_model(model)  # the service's own copy of the course's model
    if _inside(home, model):
        return str(copy_owned(Path(model), dest / "model", student))
    raise CourseError(f"the run is served on {model!r}, which is neither one of the course's "
                      f"models ({', '.join(allowed)}) nor a folder in your space")


def _inside(home: str, path: str) -> bool:
    return os.path.normpath(path).startswith(home.rstrip("/") + "/")


def copy_owned(src: Path, dest: Path, student: str) -> Path:
    """Copy the folder ``src`` to ``dest``: every entry opened without following a link, kept
    only when it is the student's own regular file or folder; anything else is refused by
    name (nothing is copied through a link)."""
    uid = pwd.getpwnam(student).pw_uid
    dest.mkdir(mode=0o700)
    try:
        fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CourseError(f"{src} cannot be served: not a folder of yours ({exc.strerror})") \
            from None
    try:
        _copy_dir(fd, src, dest, uid)
    finally:
        os.close(fd)
    return dest


def _copy_dir(fd: int, where: Path, dest: Path, uid: int) -> None:
    if os.fstat(fd).st_uid != uid:
        raise CourseError(f"{where} is not the student's own folder; nothing of it is served")
    for name in sorted(os.listdir(fd)):
        try:
            child = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            raise CourseError(f"{where / name} is a link or cannot be read: a served folder "
                              "holds the student's own files only") from None
        try:
            st = os.fstat(child)
            if st.st_uid != uid:
                raise CourseError(f"{where / name} is not the student's own file; nothing of "
                                  "it is served")
            if stat.S_ISDIR(st.st_mode):
                (dest / name).mkdir(mode=0o700)
                _copy_dir(child, where / name, dest / name, uid)
            elif stat.S_ISREG(st.st_mode) and st.st_size <= MAX_FILE_BYTES:
                with os.fdopen(os.dup(child), "rb") as src, \
                        open(dest / name, "xb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            else:
                raise CourseError(f"{where / name} is not a regular file of a model or adapter")
        finally:
            os.close(child)
