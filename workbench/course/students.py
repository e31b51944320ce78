"""Students' own spaces, and how the service starts work as a student.

Each student has one space, ``STATE_DIR/students/NAME``: owned by the student's Unix user, in the
service's group, mode 2750 (the service reads, nobody else does), with the student's
WORKBENCH_HOME (runs, registry) inside. The state folder is 0711: a student passes through it to
their own space and lists nothing.

Every piece of a student's work (planning, data preparation, training, evaluation) runs as that
student, started by the service the way JupyterHub's sudospawner starts servers: through one
command that a narrowly scoped sudo rule allows (:func:`sudoers_rule`)::

    sudo -n -u NAME -- PYTHON -I -m workbench.course.worker

with a JSON request on stdin (:mod:`workbench.course.worker` reads it). ``-I`` keeps the
student's folders, PYTHON* variables and user site-packages out of the interpreter's path, so
the worker is the course's code, run with the student's rights. The service never imports,
executes or opens with its own rights anything the student wrote.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from workbench.errors import CourseError

if TYPE_CHECKING:
    from workbench.course.config import Course

WORKER = ("-I", "-m", "workbench.course.worker")
# Passed through sudo: an interpreter built with a shared libpython outside the system's
# library path needs it to start at all.
KEPT_ENV = ("LD_LIBRARY_PATH",)


def space(course: Course, student: str) -> Path:
    return course.spaces / student


def ensure_space(course: Course, student: str) -> Path:
    """The student's space, made theirs (owner, the service's group, 2750) if it is not yet."""
    try:
        user = pwd.getpwnam(student)
    except KeyError:
        raise CourseError(f"{student} has no Unix account on the hub machine; a course's work "
                          "runs as each student's own user (docs/course.md)") from None
    root = course.spaces
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)
    path = root / student
    path.mkdir(exist_ok=True)
    st = path.lstat()
    if st.st_uid != user.pw_uid or st.st_gid != os.getgid():
        os.chown(path, user.pw_uid, os.getgid(), follow_symlinks=False)
    os.chmod(path, 0o2750)
    return path


def python(course: Course) -> str:
    return course.student_python or sys.executable


def command(course: Course, student: str) -> list[str]:
    """The worker's command line. Root may keep the library path itself; any other service user
    keeps it through the rule's ``env_keep`` (:func:`sudoers_rule`)."""
    kept = [k for k in KEPT_ENV if os.environ.get(k)]
    keep = [f"--preserve-env={','.join(kept)}"] if kept and os.geteuid() == 0 else []
    return ["sudo", "-n", *keep, "-u", student, "--", python(course), *WORKER]


class Worker:
    """One request run as a student; the answer is the worker's last stdout line (JSON)."""

    def __init__(self, course: Course, student: str, request: dict[str, Any],
                 gpus: bool = False, env: dict[str, str] | None = None) -> None:
        home = ensure_space(course, student)
        env = {**({"CUDA_VISIBLE_DEVICES": ""} if not gpus else {}), **(env or {})}
        self.request = {**request, "space": str(home), "env": env}
        self.argv = command(course, student)
        self.student = student

    def start(self) -> subprocess.Popen:
        """The worker in a session of its own (the service can end all of it)."""
        return subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd="/")

    def run(self, timeout: float | None = None) -> tuple[int, str, str, float]:
        """(exit code, stdout, stderr, seconds) of the whole request; past ``timeout`` every
        process of its session is killed and the exit code is -9."""
        started = time.time()
        proc = self.start()
        try:
            out, err = proc.communicate(json.dumps(self.request), timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            end_session(proc.pid)
            out, err = proc.communicate()
            rc = -signal.SIGKILL
        return rc, out, err, time.time() - started

    def answer(self, timeout: float | None = None) -> dict[str, Any]:
        """The worker's JSON answer; its refusal as a CourseError with the worker's message."""
        rc, out, err, _ = self.run(timeout)
        return parse_answer(rc, out, err, self.student)


def parse_answer(rc: int, out: str, err: str, student: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    answer: dict[str, Any] = {}
    if lines:
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            answer = {}
    if rc == 0 and "error" not in answer:
        return answer
    if answer.get("message"):
        raise CourseError(str(answer["message"]))
    last = (err.strip().splitlines() or ["no output"])[-1]
    if "a password is required" in err or "not allowed to execute" in err:
        raise CourseError(f"the service may not run work as {student}: install the sudo rule "
                          "that `workbench course init` wrote (docs/course.md)")
    raise CourseError(f"the work run as {student} failed (exit {rc}): {last}")


def end_session(sid: int, grace_s: float = 5.0) -> None:
    """TERM, then KILL, every process of session ``sid`` (a worker and all it started there)."""
    def members() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid:
                    found.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return found

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        procs = members()
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=wait)


def sudoers_rule(course: Course, service_user: str) -> str:
    """The sudo rule the service needs: run the worker, and nothing else, as the course's
    students (``/etc/sudoers.d/workbench-course``, checked with ``visudo -cf``)."""
    cmd = " ".join([python(course), *WORKER])
    users = ", ".join(course.students) or "nobody"
    return ("# Written by `workbench course init`: the course service starts each student's work "
            "as that student.\n"
            f"Runas_Alias WORKBENCH_STUDENTS = {users}\n"
            f"Cmnd_Alias WORKBENCH_WORKER = {cmd}\n"
            f'Defaults!WORKBENCH_WORKER env_keep += "{" ".join(KEPT_ENV)}"\n'
            f"{service_user} ALL = (WORKBENCH_STUDENTS) NOPASSWD: WORKBENCH_WORKER\n")


def read_json(path: str, student: str) -> dict[str, Any]:
    """A JSON file of a student's, opened without following a final link and read only when the
    student owns it (a link or a file of anyone else's reads as nothing): how the service reads
    progress a student's run wrote, with nothing of another's shown."""
    try:
        uid = pwd.getpwnam(student).pw_uid
        fd = os.open(os.path.realpath(os.path.dirname(path)) + "/" + os.path.basename(path),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (KeyError, OSError):
        return {}
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or st.st_size > 4 << 20:
            return {}
        try:
            data = json.loads(fh.read())
        except ValueError:
            return {}
    return data if isinstance(data, dict) else {}
