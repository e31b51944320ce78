"""Course endpoints: a student's deploy paid block by block from their credit, stopped when the
credit runs out or nobody uses it.

An endpoint runs on the course's ``serve_target``. On the hub machine (``local``) it runs as its
student, deployed by the worker in the student's space (:mod:`workbench.course.served`); on an SSH
host or a Slurm partition the service starts it with :func:`workbench.serve.deploy` like any
other, from its own copies of the student's files (:mod:`workbench.course.serving`). Its time is
held in blocks of ``endpoint_hold_minutes`` at ``prices.endpoint_hour`` (per endpoint, wherever it
runs); the first block is held before the server starts (402 when the credit is short: nothing
starts), and the service's tick meters the rest with :class:`workbench.serve.metering.BlockMeter`,
the meter a wallet's keeper uses too: next blocks held ahead, passed blocks charged, the endpoint
stopped when a block cannot be held or it idles for ``idle_minutes``. Every endpoint has its own
API key, given only to its student and the instructors, so only their requests reach it (and its
meter)."""

from __future__ import annotations

import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from workbench.course.desk import SERVICE_ACTOR, CourseDesk, Forbidden
from workbench.course.served import CourseWatch, ServedEndpoints
from workbench.course.serving import copies, student_plan
from workbench.course.students import space
from workbench.errors import (
    CourseError,
    EndpointNotFoundError,
    WorkbenchError,
)
from workbench.runs.ledger import RunHold
from workbench.serve.metering import BlockMeter, stopped_because


class EndpointMeter:
    def __init__(self, desk: CourseDesk) -> None:
        self.desk, self.course, self.ledger = desk, desk.course, desk.ledger
        self._starting: set[str] = set()  # deploys in progress in this process
        self._guard = threading.Lock()
        self.served = ServedEndpoints(self.course)
        self.meter = BlockMeter(self.ledger, self.block_s, self.course.idle_minutes * 60,
                                actor=SERVICE_ACTOR, starting=self._deploying,
                                watch=CourseWatch(self.served))

    def _deploying(self, h: RunHold) -> bool:
        return self._deploying_name(str(h.run_id))

    def _deploying_name(self, name: str) -> bool:
        with self._guard:
            return name in self._starting

    @property
    def block_s(self) -> float:
        return self.course.endpoint_hold_minutes * 60

    def _price(self) -> float:
        price = self.course.prices.endpoint_hour
        if price is None:
            raise CourseError(f"{self.course.name} has no price for endpoints "
                              "(prices.endpoint_hour), so deploying is not available; ask an "
                              "instructor")
        return price

    # -- deploying -------------------------------------------------------------------------------
    def deploy(self, user: str, runs: list[str], name: str | None = None,
               options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hold the first block, then serve the student's ``runs`` on one endpoint on the
        course's serve target."""
        from workbench.serve import deploy
        from workbench.serve.endpoint import endpoints_dir

        student = self.desk._student(user)
        price = self._price()
        if not runs:
            raise CourseError("name the run(s) to deploy: workbench.deploy(job)")
        dirs = [Path(self.desk._visible(student, run_id).run_dir or "") for run_id in runs]
        options = {k: v for k, v in (options or {}).items() if k in ("merge", "max_model_len")}
        if options.get("merge"):
            raise CourseError("a course endpoint serves the adapter on its base; merge is not "
                              "offered (deploy without merge)")
        with self.desk._lock(student):
            live = self._live_names(student)
            if len(live) >= self.course.caps.endpoints:
                raise CourseError(f"{student} already has {len(live)} endpoint(s) up "
                                  f"({', '.join(live)}); this course allows "
                                  f"{self.course.caps.endpoints}: undeploy one first")
            # Endpoint names are one namespace in the service: the name (no dot in it) then the
            # student, so two students' names can never meet.
            name = f"{_endpoint_name(name or runs[-1])}.{student}"
            if name in live:
                raise CourseError(f"endpoint {name} is up; undeploy it first or pick another name")
            as_student = self.course.serve_target == "local"
            if as_student:
                folder = space(self.course, student) / "workbench" / "endpoints" / name
            else:  # planned as the student, served from the service's copies
                plan = copies(self.course, student, student_plan(self.course, student, runs),
                              self.course.state / "serving" / name)
                folder = endpoints_dir() / name
            amount = self.course.minor(price * self.block_s / 3600)
            hold_id = self.desk._hold(student, amount, f"deploy {name}")
            started = time.time()
            # Recorded before the server starts: a service that dies while vLLM starts still
            # finds (and charges, and stops) the endpoint when it comes back.
            self.ledger.attach_run(hold_id, name, str(folder), kind="endpoint", since=started)
            with self._guard:
                self._starting.add(name)
        # Every course endpoint wants its own key, even on loopback: the hub machine is shared,
        # and only the owner's view (and instructors') carries it.
        key = secrets.token_urlsafe(24)
        try:
            if as_student:
                served = self.served.start(student, runs, name, key, options)
            else:
                ep = deploy(*dirs, name=name, keep=True, progress=False, api_key=key,
                            target=self.course.serve_target, plan=plan, **options)
        except BaseException:
            self.ledger.settle(hold_id, min(amount, self.course.minor(
                price * (time.time() - started) / 3600)), actor=SERVICE_ACTOR,
                note=f"deploy {name} failed")
            raise
        finally:
            with self._guard:
                self._starting.discard(name)
        if as_student:
            return {**self.view(name), "models": served.models}
        return {**self.view(name), "url": ep.url, "models": ep.models}

    def _live_names(self, student: str) -> list[str]:
        return sorted({str(h.run_id) for h in self.ledger.holds(student, open_only=True)
                       if h.kind == "endpoint"})

    def undeploy(self, user: str, name: str) -> dict[str, Any]:
        holds = self._holds_of(name)
        if not holds:
            raise CourseError(f"no live endpoint {name!r}; GET /endpoints lists them")
        if holds[0].student != user and not self.desk.is_instructor(user):
            raise Forbidden(f"endpoint {name} is not {user}'s; GET /endpoints lists yours")
        self.meter.stop(name, f"undeployed by {user}")
        return self.view(name)

    def _holds_of(self, name: str) -> list[RunHold]:
        return sorted((h for h in self.ledger.holds(open_only=True)
                       if h.kind == "endpoint" and h.run_id == name),
                      key=lambda h: float(h.since or h.at))

    # -- metering --------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[str]:
        """Settle passed blocks, hold next ones, stop endpoints out of credit, idle or gone;
        the names of endpoints stopped or found ended (:meth:`BlockMeter.tick`)."""
        return self.meter.tick(now)

    # -- views -----------------------------------------------------------------------------------
    def view(self, name: str) -> dict[str, Any]:
        from workbench.serve.endpoint import LIVE_STATES, Endpoint, refresh_state

        holds = [h for h in self.ledger.holds() if h.kind == "endpoint" and h.run_id == name]
        out: dict[str, Any] = {"name": name, "student": holds[0].student if holds else None,
                               "held": sum(h.amount for h in holds if h.charge is None),
                               "charged": sum(h.charge or 0 for h in holds), "state": None}
        served = self.served.get(name)
        if served is not None:
            return {**out, **self.served.view(served, starting=self._deploying_name(name))}
        try:
            record = refresh_state(name)
        except EndpointNotFoundError:
            return out
        out.update(state=record.state, url=record.url)
        if record.state in LIVE_STATES:
            # Where the hub machine, and so a student's kernel, reaches it: an SSH host's port
            # through the service's tunnel (on loopback), a Slurm node at its address.
            ep = Endpoint(record)
            try:
                out["url"] = ep.url
            except WorkbenchError:
                pass  # unreachable for now: where it listens is all there is to say
            if ep.api_key:  # the server takes requests with its key only; views go to the
                out["api_key"] = ep.api_key  # endpoint's student and instructors, nobody else
        why = stopped_because(record.endpoint_dir)
        if why is not None:
            out["stopped_because"] = why
        return out

    def endpoints(self, user: str) -> list[dict[str, Any]]:
        who = None if self.desk.is_instructor(user) else self.desk._student(user)
        names = {str(h.run_id) for h in self.ledger.holds(who) if h.kind == "endpoint"}
        return [self.view(n) for n in sorted(names)]


def _endpoint_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}", name):
        raise CourseError(f"endpoint name {name!r}: use letters, digits, '-' and '_' (no dots), "
                          "at most 48 characters")
    return name
