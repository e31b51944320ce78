"""Course endpoints: a student's deploy paid block by block from their credit, stopped when the
credit runs out or nobody uses it.

An endpoint runs on the course's ``serve_target`` (the hub machine, an SSH host or a Slurm
partition), started by :func:`workbench.serve.deploy` like any other, and everything the meter
reads or does to it goes through that serve target (:attr:`Endpoint.serve_target`): whether it is
alive, its guard's files, its /metrics (through a tunnel where needed), stopping it. Its time is
held in blocks of ``endpoint_hold_minutes`` at ``prices.endpoint_hour`` (per endpoint, wherever it
runs). The first block is held before the server starts (402 when the credit is short: nothing
starts).
:meth:`EndpointMeter.tick` (run by the service every few seconds) holds the next block shortly
before the current one ends; when that hold is refused the endpoint is stopped at once, so it
never runs on time nobody paid for. A block is charged in full once its time has passed; the
block in which the endpoint stopped is charged for the seconds it was up (until the guard's
exit.json, read where the server ran, else until the meter saw it gone: never less than it
used). Every endpoint has its own API key, given only to its student and the instructors, so
only their requests reach it (and its meter). An endpoint with no request running or finished
for ``idle_minutes`` (read from vLLM's /metrics) is stopped too.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from workbench.course.desk import SERVICE_ACTOR, CourseDesk, Forbidden
from workbench.errors import (
    CourseError,
    DeployError,
    EndpointNotFoundError,
    InsufficientCreditError,
    WorkbenchError,
)
from workbench.runs.ledger import RunHold

RENEW_AHEAD_S = 30.0  # the next block is held this long before the current one ends
STOP_FILE = "course_stop.json"  # why the course stopped an endpoint, in its folder


class EndpointMeter:
    def __init__(self, desk: CourseDesk) -> None:
        self.desk, self.course, self.ledger = desk, desk.course, desk.ledger
        self._starting: set[str] = set()  # deploys in progress in this process
        self._seen: dict[str, tuple[float | None, float]] = {}  # name -> (done, last change)
        self._guard = threading.Lock()

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

    def _used(self, h: RunHold, until: float) -> int:
        """What ``h``'s block cost up to ``until``: whole minor units, up, at most its hold."""
        seconds = max(0.0, until - float(h.since or h.at))
        return min(h.amount, self.course.minor(self._price() * seconds / 3600))

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
        with self.desk._lock(student):
            live = self._live_names(student)
            if len(live) >= self.course.caps.endpoints:
                raise CourseError(f"{student} already has {len(live)} endpoint(s) up "
                                  f"({', '.join(live)}); this course allows "
                                  f"{self.course.caps.endpoints}: undeploy one first")
            # Endpoint names are one namespace in the service: the name (no dot in it) then the
            # student, so two students' names can never meet.
            name = f"{_endpoint_name(name or runs[-1])}.{student}"
            amount = self.course.minor(price * self.block_s / 3600)
            hold_id = self.desk._hold(student, amount, f"deploy {name}")
            started = time.time()
            # Recorded before the server starts: a service that dies while vLLM starts still
            # finds (and charges, and stops) the endpoint when it comes back.
            self.ledger.attach_run(hold_id, name, str(endpoints_dir() / name), kind="endpoint",
                                   since=started)
            with self._guard:
                self._starting.add(name)
        try:
            # Every course endpoint wants its own key, even on loopback: the hub machine is
            # shared, and only the owner's view (and instructors') carries it.
            ep = deploy(*dirs, name=name, keep=True, progress=False, api_key=secrets.token_urlsafe(24),
                        target=self.course.serve_target, **options)
        except BaseException:
            self.ledger.settle(hold_id, min(amount, self.course.minor(
                price * (time.time() - started) / 3600)), actor=SERVICE_ACTOR,
                note=f"deploy {name} failed")
            raise
        finally:
            with self._guard:
                self._starting.discard(name)
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
        self._stop(name, f"undeployed by {user}")
        return self.view(name)

    def _holds_of(self, name: str) -> list[RunHold]:
        return sorted((h for h in self.ledger.holds(open_only=True)
                       if h.kind == "endpoint" and h.run_id == name),
                      key=lambda h: float(h.since or h.at))

    # -- metering --------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[str]:
        """Settle passed blocks, hold next ones, stop endpoints out of credit, idle or gone;
        the names of endpoints stopped or found ended."""
        by_name: dict[str, list[RunHold]] = {}
        for h in self.ledger.holds(open_only=True):
            if h.kind == "endpoint" and h.run_id:
                by_name.setdefault(h.run_id, []).append(h)
        ended = []
        now = time.time() if now is None else now
        for name, holds in by_name.items():
            with self._guard:
                if name in self._starting:
                    continue  # its deploy call settles it if the start fails
            holds.sort(key=lambda h: float(h.since or h.at))
            gone_at = self._ended_at(name)
            if gone_at is not None:
                for h in holds:
                    self.ledger.settle(h.hold_id, self._used(h, gone_at), actor=SERVICE_ACTOR,
                                       note=f"endpoint {name} ended")
                ended.append(name)
                continue
            for h in holds[:-1]:
                if now >= float(h.since or h.at) + self.block_s:
                    self.ledger.settle(h.hold_id, h.amount, actor=SERVICE_ACTOR,
                                       note=f"endpoint {name}: block used")
            current = holds[-1]
            block_end = float(current.since or current.at) + self.block_s
            if now >= block_end - RENEW_AHEAD_S:
                try:
                    hold_id = self.ledger.hold(current.student, current.amount,
                                               actor=SERVICE_ACTOR, note=f"endpoint {name}")
                except InsufficientCreditError:
                    if self._stop_or_retry(name, "the credit ran out", at=now):
                        ended.append(name)
                    continue
                self.ledger.attach_run(hold_id, name, str(current.run_dir), kind="endpoint",
                                       since=block_end)
            idle = self._idle_s(name, now)
            if idle > self.course.idle_minutes * 60 and self._stop_or_retry(
                    name, f"idle for {idle / 60:.1f} min", at=now):
                ended.append(name)
        return ended

    def _stop_or_retry(self, name: str, why: str, at: float) -> bool:
        """:meth:`_stop` from the meter: whether it stopped. An endpoint whose processes outlive
        the stop (or whose machine cannot say) keeps its holds open, and the next tick tries
        again, rather than ending the tick of every other endpoint."""
        try:
            self._stop(name, why, at=at)
        except DeployError:
            return False
        return True

    def _ended_at(self, name: str) -> float | None:
        """When the endpoint stopped, if it has; None while it is up. The time is the one in
        its guard's exit.json, read where the server ran; now (when the meter saw it gone) if
        that cannot be read."""
        from workbench.serve.endpoint import LIVE_STATES, refresh_state
        from workbench.serve.remote import close_tunnel
        from workbench.serve.targets import get_serve_target

        try:
            record = refresh_state(name)
        except EndpointNotFoundError:
            return time.time()  # never registered: its deploy died with the service
        if record.state in LIVE_STATES:
            return None
        close_tunnel(record.endpoint_dir)  # the meter's own tunnel to it, if one was opened
        try:
            exit_info = json.loads(get_serve_target(record.target).read(record, "exit.json"))
            return float(exit_info["time"])
        except (WorkbenchError, ValueError, KeyError, TypeError):
            return time.time()

    def _idle_s(self, name: str, now: float) -> float:
        """Seconds since a request last ran on the endpoint, as far as this service has seen
        (after a restart of the service, idle time counts again from its first look)."""
        last_done, last_change = self._seen.get(name, (None, now))
        reading = _requests_seen(name)
        if reading is not None:
            done, running = reading
            if running or (last_done is not None and done != last_done):
                last_change = now
            last_done = done
        self._seen[name] = (last_done, last_change)
        return now - last_change

    def _stop(self, name: str, why: str, at: float | None = None) -> None:
        """Stop the endpoint and settle every open block of it for the time it was up."""
        from workbench.serve.endpoint import get_endpoint

        try:
            ep = get_endpoint(name)
            ep.stop()
            (ep.dir / STOP_FILE).write_text(json.dumps({"reason": why, "time": time.time()}))
        except EndpointNotFoundError:
            pass
        stopped = time.time() if at is None else at
        for h in self._holds_of(name):  # read again: a block held in this tick is one of them
            self.ledger.settle(h.hold_id, self._used(h, stopped), actor=SERVICE_ACTOR,
                               note=f"endpoint {name} stopped: {why}")

    # -- views -----------------------------------------------------------------------------------
    def view(self, name: str) -> dict[str, Any]:
        from workbench.serve.endpoint import LIVE_STATES, Endpoint, refresh_state

        holds = [h for h in self.ledger.holds() if h.kind == "endpoint" and h.run_id == name]
        out: dict[str, Any] = {"name": name, "student": holds[0].student if holds else None,
                               "held": sum(h.amount for h in holds if h.charge is None),
                               "charged": sum(h.charge or 0 for h in holds), "state": None}
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
        try:
            out["stopped_because"] = json.loads(
                (Path(record.endpoint_dir) / STOP_FILE).read_text())["reason"]
        except (OSError, ValueError, KeyError):
            pass
        return out

    def endpoints(self, user: str) -> list[dict[str, Any]]:
        who = None if self.desk.is_instructor(user) else self.desk._student(user)
        names = {str(h.run_id) for h in self.ledger.holds(who) if h.kind == "endpoint"}
        return [self.view(n) for n in sorted(names)]


def _requests_seen(name: str) -> tuple[float, float] | None:
    """(requests finished, requests running) from vLLM's Prometheus /metrics, reached through
    the endpoint's serve target (an SSH tunnel, a Slurm node's address); None: no reading
    (starting, stopped or not answering)."""
    from workbench.serve.endpoint import get_endpoint

    try:
        ep = get_endpoint(name)
        req = urllib.request.Request(f"{ep.url}/metrics", headers=ep._headers())
        with urllib.request.urlopen(req, timeout=3) as resp:
            text = resp.read().decode("utf-8", "replace")
    except Exception:
        return None
    done = running = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            done += float(line.rsplit(" ", 1)[-1])
        elif line.startswith("vllm:num_requests_running"):
            running += float(line.rsplit(" ", 1)[-1])
    return done, running


def _endpoint_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}", name):
        raise CourseError(f"endpoint name {name!r}: use letters, digits, '-' and '_' (no dots), "
                          "at most 48 characters")
    return name
