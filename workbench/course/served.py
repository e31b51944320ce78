"""Course endpoints on the hub machine, served as their students.

On the ``local`` serve target (the hub machine, where every student is a Unix user) the service
asks the worker to deploy the student's runs in the student's own space: the guard and vLLM run
as the student and read the student's files with the student's rights. The service keeps its own
record of each endpoint (``state_dir/served/NAME.json``): the student, the guard process the
worker started (checked to be the student's) and every descendant of it seen since, the port and
the key. The block meter (:class:`workbench.serve.metering.BlockMeter`) sees and stops these
endpoints through :class:`CourseWatch`: an endpoint is up while a recorded process lives and ended
when the service first sees none (so the bill covers every second it may have run); it is stopped
through the worker, by the recorded processes. Nothing in the student's folder is evidence.
"""

from __future__ import annotations

import json
import pwd
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

from workbench.course.meter import follow
from workbench.course.records import Records
from workbench.course.students import Worker
from workbench.errors import CourseError, DeployError, WorkbenchError
from workbench.serve.metering import RegistryWatch, read_requests

if TYPE_CHECKING:
    from workbench.course.config import Course

START_TIMEOUT_S = 600.0  # the worker's deploy plus vLLM's start, as deploy() allows


@dataclass
class Served:
    name: str
    student: str
    uid: int
    api_key: str
    started: float
    endpoint_dir: str = ""
    port: int = 0
    procs: list[tuple[int, float]] = field(default_factory=list)  # the guard first
    models: list[str] = field(default_factory=list)  # what the server lists, once it answers
    gone: float | None = None  # when the service first saw none of them running
    why: str | None = None  # why the service stopped it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ServedEndpoints:
    """The service's records of the endpoints its students run on the hub machine."""

    def __init__(self, course: Course) -> None:
        self.course = course
        self.records = Records(course.state / "served")

    def save(self, s: Served) -> None:
        self.records.write(s.name, asdict(s))

    def get(self, name: str) -> Served | None:
        data = self.records.read(name)
        if data is None:
            return None
        data["procs"] = [tuple(p) for p in data["procs"]]
        return Served(**data)

    # -- starting --------------------------------------------------------------------------------
    def start(self, student: str, runs: list[str], name: str, api_key: str,
              options: dict[str, Any]) -> Served:
        """Deploy ``runs`` as ``student`` and wait until the server answers; on any failure what
        the worker started is stopped and the error raised."""
        s = Served(name, student, pwd.getpwnam(student).pw_uid, api_key, time.time())
        # Recorded before the worker starts anything: a service that dies now finds the record
        # on its return, with no process in it, and stops the endpoint by name (ended_at).
        self.save(s)
        try:
            answer = Worker(self.course, student, {"verb": "serve", "runs": runs, "name": name,
                                                   "api_key": api_key, **options,
                                                   "python": self.course.serve_python},
                            gpus=True).answer(timeout=START_TIMEOUT_S)
            pid, started = answer["guard"]
            try:
                owner = psutil.Process(int(pid)).uids().real
            except psutil.NoSuchProcess:
                owner = s.uid  # it ended already: the health wait below says why
            if owner != s.uid:
                raise CourseError(f"endpoint {name}'s process {pid} is not {student}'s; "
                                  "nothing is served that the service cannot tie to the student")
            s.procs = [(int(pid), float(started))]
            s.endpoint_dir = str(answer["endpoint_dir"])
            s.port = int(str(answer["url"]).rsplit(":", 1)[1])
            follow(s.procs)
            self.save(s)
            self._wait_healthy(s, time.time() + START_TIMEOUT_S)
            s.models = self._models(s)
            self.save(s)
        except BaseException as exc:
            log = self.stop(s, "it did not start")
            if isinstance(exc, DeployError) and log:
                raise DeployError(f"{exc}; the server's last lines: {log[-1500:]}") from None
            raise
        return s

    def _wait_healthy(self, s: Served, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{s.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if not follow(s.procs):
                raise DeployError(f"endpoint {s.name} ended before it answered")
            if time.time() > deadline:
                raise DeployError(f"endpoint {s.name} did not answer within "
                                  f"{START_TIMEOUT_S:.0f} s")
            time.sleep(1.0)

    @staticmethod
    def _models(s: Served) -> list[str]:
        req = urllib.request.Request(f"{s.url}/v1/models",
                                     headers={"Authorization": f"Bearer {s.api_key}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return [str(m["id"]) for m in json.loads(resp.read())["data"]]

    # -- watching --------------------------------------------------------------------------------
    def ended_at(self, s: Served) -> float | None:
        """None while a recorded process runs; else when the service first saw none."""
        if s.gone is None:
            alive = follow(s.procs)
            if alive:
                self.save(s)  # descendants seen this time are kept
                return None
            if not s.procs:  # its deploy died before the worker answered: stop it by name
                self._unserve(s, "its deploy did not finish")
            s.gone = time.time()
            self.save(s)
        return s.gone

    def requests_seen(self, s: Served) -> tuple[float, float] | None:
        if not s.port:
            return None
        return read_requests(s.url, {"Authorization": f"Bearer {s.api_key}"})

    def stop(self, s: Served, why: str) -> str:
        """Stop it through the worker (as its student); the last lines of its server's log, read
        as the student. DeployError when a recorded process outlives that (the meter tries again
        at its next tick)."""
        s.why = s.why or why
        self.save(s)
        log = self._unserve(s, why)
        if follow(s.procs):
            raise DeployError(f"endpoint {s.name} still runs after it was stopped")
        if s.gone is None:
            s.gone = time.time()
        self.save(s)
        return log

    def _unserve(self, s: Served, why: str) -> str:
        try:
            return str(Worker(self.course, s.student, {"verb": "unserve", "name": s.name,
                                                        "why": why, "procs": s.procs}
                              ).answer(timeout=120).get("log") or "")
        except WorkbenchError:
            return ""  # judged by the processes: stop() raises while they live

    def view(self, s: Served, starting: bool) -> dict[str, Any]:
        # A deploy under way has no process on record yet: only its own call may judge it.
        state = "starting" if starting else (
            "stopped" if self.ended_at(s) is not None else "healthy")
        out: dict[str, Any] = {"state": state, "url": s.url}
        if state != "stopped":
            out["api_key"] = s.api_key  # the view goes to its student and instructors only
        if s.why:
            out["stopped_because"] = s.why
        return out


class CourseWatch(RegistryWatch):
    """The meter's view of a course's endpoints: the ones its students run (on record in
    :class:`ServedEndpoints`) by the service's record, the rest (on a remote serve target) by the
    service's registry."""

    def __init__(self, served: ServedEndpoints) -> None:
        self.served = served

    def ended_at(self, name: str) -> float | None:
        s = self.served.get(name)
        return super().ended_at(name) if s is None else self.served.ended_at(s)

    def requests_seen(self, name: str) -> tuple[float, float] | None:
        s = self.served.get(name)
        return super().requests_seen(name) if s is None else self.served.requests_seen(s)

    def stop(self, name: str, why: str) -> None:
        s = self.served.get(name)
        if s is None:
            super().stop(name, why)
        else:
            self.served.stop(s, why)
