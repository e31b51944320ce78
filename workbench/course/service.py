"""The course service: a JupyterHub service that owns a class's money and starts its runs.

The hub starts it (``c.JupyterHub.services``, written by :mod:`workbench.course.config`) as the
hub's user with WORKBENCH_HOME in the course's private state folder; requests carry a hub token
(``Authorization: token ...``), checked by JupyterHub's own ``HubAuth``. Routes, each a thin
adapter over :class:`~workbench.course.desk.CourseDesk`:

    GET  /me            credit left, holds and charges, own runs
    POST /quote         what a spec would hold (body: a RunSpec mapping)
    POST /launch        hold the planned cost, then launch (402 when the credit is short)
    GET  /runs          own runs (instructors: every run);  GET /runs/RUN  one run
    POST /stop/RUN      students their own runs, instructors any
    POST /resume/RUN    hold what the resumed run may cost, then resume it (body: changes)
    POST /evaluate/RUN  score an ended run, held for eval_minutes at the rate of where it runs
    POST /export/RUN    export an ended run into its folder (body: formats, quant), held and
                        charged as an evaluation
                        (the run's GPUs on its target, else one core) (body: tasks)
    POST /deploy        hold an endpoint's first block, then serve (body: runs, name)
    GET  /endpoints     own endpoints (instructors: all);  POST /undeploy/NAME
    POST /sweep         hold the sweep's whole budget, then start it (body: {"spec", "space",
                        "options": sweep()'s keywords}); 402 when the credit is short
    GET  /sweeps        own sweeps (instructors: all);  GET /sweeps/ID  one, with its trials
    POST /sweeps/ID/stop  students their own sweeps, instructors any
    POST /grant         instructors: {"student", "amount", "note"}
    GET  /students      instructors: each student's credit, held, spent and runs
    GET  /export.csv    instructors: spend per student

Every ``SETTLE_EVERY_S`` the service settles ended runs and sweeps' ended trials, including those
that ended while it was down (the holds and their runs are in the ledger, not in this process),
resumes sweeps whose controller died (or ends those that cannot go on), and meters endpoints
(:class:`~workbench.course.endpoints.EndpointMeter`).

    python -m workbench.course.service STATE_DIR/course.json
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from jupyterhub.services.auth import HubAuthenticated
from tornado import web

from workbench.course.config import SERVICE_NAME, load_course
from workbench.course.desk import CourseDesk, Forbidden
from workbench.course.endpoints import EndpointMeter
from workbench.course.sweeps import CourseSweeps
from workbench.errors import InsufficientCreditError, RunNotFoundError, WorkbenchError

SETTLE_EVERY_S = 2.0
log = logging.getLogger("workbench.course")


class _Handler(HubAuthenticated, web.RequestHandler):
    def initialize(self, desk: CourseDesk, pool: ThreadPoolExecutor,
                   meter: EndpointMeter, sweeps: CourseSweeps) -> None:
        self.desk, self.pool, self.meter, self.sweeps = desk, pool, meter, sweeps

    def user(self) -> str:
        model = self.get_current_user()
        if not model or model.get("kind") != "user":
            raise web.HTTPError(403, "a hub user's token is needed (Authorization: token ...)")
        return str(model["name"])

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run a desk call off the event loop (planning and launching take seconds)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def body(self, allowed: tuple[str, ...] | None = None, usage: str = "") -> dict[str, Any]:
        """The JSON object sent; with ``allowed``, any other key is refused (400, ``usage``)."""
        try:
            data = json.loads(self.request.body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _Refused(400, f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise _Refused(400, "the body must be a JSON object")
        unknown = sorted(set(data) - set(allowed)) if allowed is not None else []
        if unknown:
            raise _Refused(400, f"unknown field(s) {unknown}; give {usage}")
        return data

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        message = getattr(exc, "log_message", None) or str(exc or self._reason)
        self.finish({"error": type(exc).__name__ if exc else "HTTPError", "message": message})

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, (WorkbenchError, _Refused)):
            code = _status_of(e)
            self.set_status(code)
            self.finish({"error": getattr(e, "kind", type(e).__name__), "message": str(e)})
            return
        super()._handle_request_exception(e)  # type: ignore[arg-type]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, "BadRequest"


def _status_of(e: BaseException) -> int:
    if isinstance(e, _Refused):
        return e.status
    if isinstance(e, InsufficientCreditError):
        return 402
    if isinstance(e, Forbidden):
        return 403
    if isinstance(e, RunNotFoundError):
        return 404
    return 400  # a spec, plan, cap or budget the course refuses: the message says what to change


class Me(_Handler):
    async def get(self) -> None:
        self.finish(await self.call(self.desk.me, self.user()))


class Quote(_Handler):
    async def post(self) -> None:
        q = await self.call(self.desk.quote, self.user(), self.body())
        self.finish({"hold": q["hold"], "hold_text": q["hold_text"],
                     "planned_cost": q["planned_cost"], "currency": self.desk.course.currency,
                     "hours": q["plan"].hours})


class Launch(_Handler):
    async def post(self) -> None:
        self.set_status(201)
        self.finish(await self.call(self.desk.launch, self.user(), self.body()))


class Runs(_Handler):
    async def get(self, run_id: str | None = None) -> None:
        user = self.user()
        if run_id:
            self.finish(await self.call(self.desk.run, user, run_id))
        else:
            self.finish({"runs": await self.call(self.desk.runs, user)})


class Stop(_Handler):
    async def post(self, run_id: str) -> None:
        state = await self.call(self.desk.stop, self.user(), run_id)
        self.finish({"run": run_id, "state": state})


def _count(value: Any, what: str) -> int:
    """A whole number of at least 1 from a JSON body, or 400 saying what to send."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Refused(400, f"{what} must be a whole number of at least 1, got {value!r}")
    return value


MAX_AMOUNT = 1e9  # currency units: far above any grant, far below what the ledger can keep


def _amount(value: Any) -> float:
    """A positive, finite amount of money from a JSON body (a number, not text), or 400."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= MAX_AMOUNT:
        raise _Refused(400, f'amount must be a positive number in currency units (e.g. 5 or '
                            f'2.5, at most {MAX_AMOUNT:.0f}), got {value!r}')
    return float(value)


class Resume(_Handler):
    async def post(self, run_id: str) -> None:
        usage = '{"changes": {"train.max_steps": N}}'
        changes = self.body(("changes",), usage).get("changes") or {}
        if not isinstance(changes, dict):
            raise _Refused(400, f"give {usage}")
        changes = {k: _count(v, k) for k, v in changes.items()}
        self.finish(await self.call(self.desk.resume, self.user(), run_id, changes))


class ExportRun(_Handler):
    async def post(self, run_id: str) -> None:
        usage = '{"formats": ["merged", "gguf", "ollama"], "quant": ["f16", "q4_k_m"]}'
        body = self.body(("formats", "quant"), usage)
        lists = {}
        for key, allowed in (("formats", r"merged|gguf|ollama"), ("quant", r"[a-z0-9_]{2,12}")):
            value = body.get(key) or (["merged"] if key == "formats" else ["f16"])
            if not (isinstance(value, list) and value and all(
                    isinstance(v, str) and re.fullmatch(allowed, v) for v in value)):
                raise _Refused(400, f"give {usage}")
            lists[key] = value
        self.finish(await self.call(self.desk.export, self.user(), run_id, lists["formats"],
                                    lists["quant"]))


class Evaluate(_Handler):
    async def post(self, run_id: str) -> None:
        usage = '{"tasks": ["heldout", ...], "max_samples": N, "max_new_tokens": N}'
        body = self.body(("tasks", "max_samples", "max_new_tokens"), usage)
        tasks = body.get("tasks")
        if tasks is not None and not (isinstance(tasks, list)
                                      and all(isinstance(t, str) for t in tasks)):
            raise _Refused(400, 'give {"tasks": ["heldout", ...]} (task names) or no tasks')
        knobs = {k: _count(body[k], k) for k in ("max_samples", "max_new_tokens")
                 if body.get(k) is not None}
        self.finish(await self.call(self.desk.evaluate, self.user(), run_id, tasks, knobs))


class Deploy(_Handler):
    async def post(self) -> None:
        usage = '{"runs": [RUN_ID, ...], "name": optional, "options": optional}'
        body = self.body(("runs", "name", "options"), usage)
        runs = body.get("runs")
        if not isinstance(runs, list) or not runs or not all(isinstance(r, str) for r in runs):
            raise _Refused(400, f"give {usage}")
        name, options = body.get("name"), body.get("options") or {}
        if name is not None and not isinstance(name, str):
            raise _Refused(400, f"name must be text, got {name!r}")
        if not isinstance(options, dict):
            raise _Refused(400, 'options must be an object: {"merge": true, "max_model_len": N}')
        self.set_status(201)
        self.finish(await self.call(self.meter.deploy, self.user(), runs, name, options))


class Endpoints(_Handler):
    async def get(self) -> None:
        self.finish({"endpoints": await self.call(self.meter.endpoints, self.user())})


class Undeploy(_Handler):
    async def post(self, name: str) -> None:
        self.finish(await self.call(self.meter.undeploy, self.user(), name))


class Sweep(_Handler):
    async def post(self) -> None:
        usage = '{"spec": {...}, "space": {...}, "options": {"budget": N}}'
        body = self.body(("spec", "space", "options"), usage)
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise _Refused(400, f"give {usage}")
        if not isinstance(body.get("spec"), dict):
            raise _Refused(400, "spec must be a mapping (the course reads no path or text from "
                                f"its own disk); give {usage}")
        self.set_status(201)
        self.finish(await self.call(self.sweeps.start, self.user(), body.get("spec"),
                                    body.get("space"), options))


class Sweeps(_Handler):
    async def get(self, sweep_id: str | None = None) -> None:
        user = self.user()
        if sweep_id:
            self.finish(await self.call(self.sweeps.view, user, sweep_id))
        else:
            self.finish({"sweeps": await self.call(self.sweeps.sweeps, user)})


class StopSweep(_Handler):
    async def post(self, sweep_id: str) -> None:
        self.finish(await self.call(self.sweeps.stop, self.user(), sweep_id))


class Students(_Handler):
    async def get(self) -> None:
        self.finish({"students": await self.call(self.desk.students_table, self.user()),
                     "currency": self.desk.course.currency,
                     "minor_per_unit": self.desk.course.minor_per_unit})


class Grant(_Handler):
    async def post(self) -> None:
        usage = '{"student": NAME, "amount": N, "note": optional}'
        body = self.body(("student", "amount", "note"), usage)
        student, note = body.get("student"), body.get("note", "")
        if not isinstance(student, str) or not isinstance(note, str):
            raise _Refused(400, f"give {usage} (student and note as text)")
        self.finish(await self.call(self.desk.grant, self.user(), student,
                                    _amount(body.get("amount")), note))


class Export(_Handler):
    async def get(self) -> None:
        text = await self.call(self.desk.export_csv, self.user())
        self.set_header("Content-Type", "text/csv; charset=utf-8")
        self.finish(text)


def make_app(desk: CourseDesk, meter: EndpointMeter, prefix: str = "/") -> web.Application:
    # Deploys and evaluations hold a worker for a minute or more: enough for the rest.
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="course")
    args = {"desk": desk, "pool": pool, "meter": meter, "sweeps": CourseSweeps(desk)}
    p = prefix.rstrip("/")
    return web.Application([
        (f"{p}/me", Me, args), (f"{p}/quote", Quote, args), (f"{p}/launch", Launch, args),
        (f"{p}/runs", Runs, args), (f"{p}/runs/([^/]+)", Runs, args),
        (f"{p}/stop/([^/]+)", Stop, args), (f"{p}/resume/([^/]+)", Resume, args),
        (f"{p}/evaluate/([^/]+)", Evaluate, args),
        (f"{p}/export/([^/]+)", ExportRun, args), (f"{p}/deploy", Deploy, args),
        (f"{p}/endpoints", Endpoints, args), (f"{p}/undeploy/([^/]+)", Undeploy, args),
        (f"{p}/sweep", Sweep, args), (f"{p}/sweeps", Sweeps, args),
        (f"{p}/sweeps/([^/]+)", Sweeps, args), (f"{p}/sweeps/([^/]+)/stop", StopSweep, args),
        (f"{p}/grant", Grant, args),
        (f"{p}/students", Students, args), (f"{p}/export.csv", Export, args),
    ])


async def _settle_forever(desk: CourseDesk, meter: EndpointMeter) -> None:
    loop = asyncio.get_running_loop()
    sweeps = CourseSweeps(desk)
    while True:
        for job in (desk.settle_ended, meter.tick, sweeps.settle):
            try:
                for name in await loop.run_in_executor(None, job):
                    log.info("settled %s", name)
            except Exception:  # a bad run dir must not stop the settling of every other run
                log.exception("settling failed; retrying")
        await asyncio.sleep(SETTLE_EVERY_S)


async def serve(course_file: str) -> None:
    course = load_course(course_file)
    desk = CourseDesk(course)
    desk.open_accounts()
    # The hub tells a managed service where to listen and under which prefix it is proxied.
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", course.service_url))
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE_NAME}/")
    meter = EndpointMeter(desk)
    app = make_app(desk, meter, prefix)
    app.listen(url.port or 80, url.hostname or "127.0.0.1")
    log.info("course service for %s on %s%s", course.name, url.geturl(), prefix)
    await _settle_forever(desk, meter)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workbench.course.service STATE_DIR/course.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[course %(asctime)s] %(message)s")
    os.umask(0o077)  # runs, logs and the ledger stay the service's own
    # The hub stops its services with SIGINT, then SIGTERM: either ends the service between
    # settlements (the ledger is written in transactions), a stop, not a crash to log.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(serve(argv[0]))
    except KeyboardInterrupt:
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
