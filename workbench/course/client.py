"""The course service seen from a student's kernel: launch, follow and stop runs, read credit.

Under a course hub the single-user server's environment holds ``JUPYTERHUB_API_TOKEN`` and
``WORKBENCH_COURSE_URL`` (set by the hub config), and :func:`workbench.launch` sends the spec
here instead of starting it: the service holds the price against the student's credit and owns
the run. Refusals come back as the same typed errors the service raised.

    >>> course = CourseClient()                          # doctest: +SKIP
    >>> course.me()["balance_text"]                      # doctest: +SKIP
    '9.57 CNY'
    >>> job = course.launch({"train": {"max_steps": 20}})  # doctest: +SKIP
    >>> job.wait()                                       # doctest: +SKIP
    'succeeded'
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from workbench.errors import CourseError, InsufficientCreditError, RunNotFoundError

TERMINAL = ("succeeded", "failed", "cancelled", "budget_stopped")


def in_course() -> bool:
    """True in a kernel started by a course hub (the hook in workbench.runs.launching asks this)."""
    return bool(os.environ.get("WORKBENCH_COURSE_URL") and os.environ.get("JUPYTERHUB_API_TOKEN"))


class CourseClient:
    def __init__(self, url: str | None = None, token: str | None = None,
                 timeout: float = 300.0) -> None:
        self.url = (url or os.environ.get("WORKBENCH_COURSE_URL", "")).rstrip("/") + "/"
        self.token = token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if self.url == "/" or not self.token:
            raise CourseError("no course service: set WORKBENCH_COURSE_URL and "
                              "JUPYTERHUB_API_TOKEN (the hub sets both in a course's servers)")
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
                kind = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise _error(exc) from None
        except urllib.error.URLError as exc:
            raise CourseError(f"the course service at {self.url} is not reachable ({exc.reason});"
                              " ask an instructor whether the hub is up") from None
        return json.loads(text) if kind.startswith("application/json") else text

    def me(self) -> dict[str, Any]:
        return dict(self.request("GET", "me"))

    def quote(self, spec: Any) -> dict[str, Any]:
        return dict(self.request("POST", "quote", _spec_body(spec)))

    def launch(self, spec: Any) -> CourseJob:
        answer = self.request("POST", "launch", _spec_body(spec))
        return CourseJob(self, answer["run"], answer)

    def runs(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "runs")["runs"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"runs/{run_id}"))

    def stop(self, run_id: str) -> str:
        return str(self.request("POST", f"stop/{run_id}")["state"])

    def resume(self, run_id: str, **changes: Any) -> dict[str, Any]:
        return dict(self.request("POST", f"resume/{run_id}", {"changes": changes}))

    def evaluate(self, run_id: str, tasks: list[str] | None = None,
                 **knobs: Any) -> dict[str, Any]:
        return dict(self.request("POST", f"evaluate/{run_id}", {"tasks": tasks, **knobs}))

    def export(self, run_id: str, formats: list[str], quant: list[str]) -> dict[str, Any]:
        return dict(self.request("POST", f"export/{run_id}", {"formats": formats,
                                                              "quant": quant}))

    def deploy(self, runs: list[str], name: str | None = None,
               **options: Any) -> CourseEndpoint:
        answer = self.request("POST", "deploy", {"runs": runs, "name": name,
                                                 "options": options})
        return CourseEndpoint(self, answer["name"], answer)

    def endpoints(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "endpoints")["endpoints"])

    def undeploy(self, name: str) -> dict[str, Any]:
        return dict(self.request("POST", f"undeploy/{name}"))

    def sweep(self, spec: Any, space: Any, **options: Any) -> CourseSweep:
        answer = self.request("POST", "sweep", {"spec": _spec_body(spec), "space": space,
                                                "options": options})
        return CourseSweep(self, answer["sweep"], answer)

    def sweeps(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "sweeps")["sweeps"])

    def sweep_view(self, sweep_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"sweeps/{sweep_id}"))

    def stop_sweep(self, sweep_id: str) -> str:
        return str(self.request("POST", f"sweeps/{sweep_id}/stop")["state"])

    def students(self) -> dict[str, Any]:
        return dict(self.request("GET", "students"))

    def grant(self, student: str, amount: float, note: str = "") -> dict[str, Any]:
        return dict(self.request("POST", "grant",
                                 {"student": student, "amount": amount, "note": note}))

    def export_csv(self) -> str:
        return str(self.request("GET", "export.csv"))


def _poll_state(status: Callable[[], dict[str, Any]], done: Callable[[dict[str, Any]], bool],
                timeout: float | None, poll: float) -> str:
    """Read ``status`` every ``poll`` seconds until ``done`` says so (or ``timeout``); the state
    the last read gave."""
    deadline = None if timeout is None else time.time() + timeout
    while True:
        s = status()
        if done(s) or (deadline is not None and time.time() > deadline):
            return str(s.get("state"))
        time.sleep(poll)


class CourseJob:
    """A run the course service owns: state, wait and cancel, read through the service."""

    def __init__(self, client: CourseClient, run_id: str, launched: dict[str, Any]) -> None:
        self.client, self.id, self.launched = client, run_id, launched

    def __repr__(self) -> str:
        return f"<CourseJob {self.id} {self.state}>"

    def status(self) -> dict[str, Any]:
        return self.client.run(self.id)

    @property
    def state(self) -> str:
        return str(self.status().get("state") or "pending")

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Until the run ends and its charge is settled (or ``timeout``); the state."""
        return _poll_state(self.status, lambda s: s.get("state") in TERMINAL
                           and s.get("charge") is not None, timeout, poll)

    def cancel(self) -> str:
        return self.client.stop(self.id)

    def resume(self, **changes: Any) -> CourseJob:
        """Resume through the course: what it may cost is held first (402 when the credit is
        short); ``changes`` may raise ``train.max_steps`` or ``train.epochs``."""
        self.launched = self.client.resume(self.id, **changes)
        return self

    def evaluate(self, tasks: Any = None, **knobs: Any) -> dict[str, Any]:
        """Score this ended run in the course service (held, then charged by the second); the
        scores join the run's eval.jsonl. Returns the score table and the charge."""
        if isinstance(tasks, str):
            tasks = [tasks]
        return self.client.evaluate(self.id, tasks, **knobs)

    def export(self, formats: Any = ("merged",), quant: Any = ("f16",)) -> dict[str, Any]:
        """Export this ended run in the course service, as you, into the run's own folder
        (held, then charged by the second, as an evaluation): its folders and checks."""
        return self.client.export(self.id, [formats] if isinstance(formats, str) else
                                  list(formats), [quant] if isinstance(quant, str) else list(quant))

    def deploy(self, *more: Any, name: str | None = None, **options: Any) -> CourseEndpoint:
        return deploy_via_course(self, *more, name=name, **options)


class CourseSweep:
    """A sweep the course service runs on one hold of the student's credit."""

    def __init__(self, client: CourseClient, sweep_id: str, started: dict[str, Any]) -> None:
        self.client, self.id, self.started = client, sweep_id, started

    def __repr__(self) -> str:
        return f"<CourseSweep {self.id} {self.state}>"

    def status(self) -> dict[str, Any]:
        """State, trials (each with its charge), what is left of the hold, what was charged."""
        return self.client.sweep_view(self.id)

    @property
    def state(self) -> str:
        return str(self.status().get("state") or "running")

    @property
    def trials(self) -> list[dict[str, Any]]:
        return list(self.status()["trials"])

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Until the sweep ends and its hold is settled (or ``timeout``); the state."""
        return _poll_state(self.status, lambda s: bool(s.get("settled")), timeout, poll)

    def cancel(self) -> str:
        return self.client.stop_sweep(self.id)


class CourseEndpoint:
    """An endpoint the course service runs, paid by the hour from the student's credit."""

    def __init__(self, client: CourseClient, name: str, view: dict[str, Any]) -> None:
        self.client, self.name, self.view = client, name, view

    def __repr__(self) -> str:
        return f"<CourseEndpoint {self.name} {self.view.get('state')} {self.url}>"

    @property
    def url(self) -> str:
        return str(self.view.get("url") or "")

    def refresh(self) -> dict[str, Any]:
        for view in self.client.endpoints():
            if view["name"] == self.name:
                self.view = view
        return self.view

    @property
    def state(self) -> str:
        return str(self.refresh().get("state"))

    def chat(self, message: str, model: str | None = None, max_tokens: int = 64) -> str:
        body = {"model": model or (self.view.get("models") or [""])[-1], "max_tokens": max_tokens,
                "temperature": 0.0, "messages": [{"role": "user", "content": message}]}
        headers = {"Content-Type": "application/json"}
        if self.view.get("api_key"):  # an endpoint off the hub machine (a Slurm node) wants it
            headers["Authorization"] = f"Bearer {self.view['api_key']}"
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", method="POST",
                                     data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return str(json.loads(resp.read())["choices"][0]["message"]["content"])
        except urllib.error.HTTPError as exc:
            raise CourseError(f"endpoint {self.name} refused the chat ({exc.code} {exc.reason}): "
                              "refresh it (ep.refresh()) and ask again; if it persists, ask "
                              "an instructor") from exc

    def stop(self) -> str:
        self.view = self.client.undeploy(self.name)
        return str(self.view.get("state"))


def launch_via_course(spec: Any, force: bool = False) -> CourseJob:
    """What ``workbench.launch`` does under a course hub (``force`` is not the student's to
    give: the course plans every run)."""
    if force:
        raise CourseError("force=True is not available in a course: the course service plans "
                          "and prices every run; make the run fit instead")
    return CourseClient().launch(spec)


def deploy_via_course(source: Any, *more: Any, name: str | None = None,
                      **options: Any) -> CourseEndpoint:
    """What ``workbench.deploy`` does under a course hub: the service serves the student's runs
    (CourseJobs or run ids) and holds the endpoint's time against their credit."""
    runs = [s.id if isinstance(s, CourseJob) else s for s in (source, *more)]
    if not all(isinstance(r, str) for r in runs):
        raise CourseError("in a course, deploy the course's runs: workbench.deploy(job) with the "
                          "job workbench.launch returned, or its run id")
    unknown = set(options) - {"merge", "max_model_len"}
    if unknown:
        raise CourseError(f"in a course the service chooses {sorted(unknown)}; deploy takes "
                          "name=, merge= and max_model_len=")
    return CourseClient().deploy(runs, name=name, **options)


def sweep_via_course(spec: Any, space: Any, target: str | None = None,
                     **options: Any) -> CourseSweep:
    """What ``workbench.sweep`` does under a course hub: the service holds the sweep's whole
    budget (``budget=``, or its trials' quotes) against the student's credit (402 when short,
    before anything starts), runs it, charges each trial and releases the rest at the end."""
    from workbench.spec import RunSpec

    base = RunSpec.coerce(spec)
    if target is not None:
        base = base.updated(target=target)
    return CourseClient().sweep(base, space, **options)


def _spec_body(spec: Any) -> dict[str, Any]:
    from workbench.spec import RunSpec

    return RunSpec.coerce(spec).model_dump(mode="json")


def _error(exc: urllib.error.HTTPError) -> Exception:
    try:
        message = json.loads(exc.read().decode()).get("message") or exc.reason
    except (ValueError, AttributeError):
        message = str(exc.reason)
    if exc.code == 402:
        err = InsufficientCreditError("", 0, 0)
        err.args = (message,)
        return err
    if exc.code == 404:
        return RunNotFoundError(message)
    if exc.code == 403:
        return CourseError(f"not allowed ({exc.code}): {message}")
    return CourseError(f"the course service refused ({exc.code}): {message}")
