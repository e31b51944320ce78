"""REST routes of the Workbench panel: a declarative list of (regex, handler) under /workbench/api.

Handlers only adapt HTTP to :class:`workbench_lab.view.RunsView` (which calls the workbench
library). They derive from jupyter_server's ``APIHandler`` and are ``@tornado.web.authenticated``,
so Jupyter's own token/cookie authentication and XSRF checks apply; typed workbench errors map
to status codes with the error's message as the reason the panel shows.

    GET  /workbench/api/runs                    every run (+ endpoints) and the capabilities
    GET  /workbench/api/runs/RUN_ID             details: summary, loss points, log tail, snapshots
    GET  /workbench/api/runs/RUN_ID/logs        ?name=rank-0.log&tail=200
    GET  /workbench/api/compare?runs=ID,ID      runs side by side: differing settings, scores, curves
    POST /workbench/api/runs/RUN_ID/cancel|resume|deploy|export|tensorboard
                                                deploy: optional {"target": "local|ssh:NAME|..."}
                                                export: {"formats": ["merged"], "quant": ["f16"]}
                                                resume: optional {"budget_limit": 100}
    POST /workbench/api/endpoints/NAME/stop     stop a deployed endpoint
    POST /workbench/api/notebooks               {"directory": "", "target": "local"} -> {"path"}
                                                {"directory": "", "runs": [ID, ID, ...]}: compare
    GET  /workbench/api/course                  the student's credit; instructors: every student
    POST /workbench/api/course/grant            instructors: {"student", "amount", "note"}
    GET|POST /workbench/tensorboard/RUN_ID/...  the run's TensorBoard (started by the POST above)
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

import tornado.web
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import ensure_async, url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from workbench.errors import WorkbenchError
from workbench_lab.course import course_grant, course_panel
from workbench_lab.exporting import ExportRequestError
from workbench_lab.template import compare_notebook, new_run_notebook
from workbench_lab.tensorboard import TensorBoardError, TensorBoards
from workbench_lab.view import RUN_ID_PATTERN, InvalidRequestError, RunsView, UnsupportedError

T = TypeVar("T")
_STATUS = ((LookupError, 404), (InvalidRequestError, 400), (ExportRequestError, 400),
           (UnsupportedError, 501),
           (TensorBoardError, 409), (WorkbenchError, 409))
_MAX_TAIL = 5000


class WorkbenchHandler(APIHandler):
    @property
    def view(self) -> RunsView:
        return self.settings["workbench_view"]

    @property
    def tensorboards(self) -> TensorBoards:
        return self.settings["workbench_tensorboards"]

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (blocking, file-reading) library call off the event loop; typed errors -> HTTP."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
        except WorkbenchError as exc:
            code = next(c for cls, c in _STATUS if isinstance(exc, cls))
            raise tornado.web.HTTPError(code, reason=str(exc).splitlines()[0][:300]) from exc

    def reply(self, data: Any) -> None:
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(_finite(data), default=str, allow_nan=False))

    def tail(self) -> int:
        try:
            return max(1, min(int(self.get_query_argument("tail", "100")), _MAX_TAIL))
        except ValueError:
            raise tornado.web.HTTPError(400, reason="tail must be an integer") from None


class RunsHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply(await self.call(self.view.runs))


class RunHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        self.reply(await self.call(self.view.details, run_id, self.tail()))


class CompareHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        runs = [r for r in self.get_query_argument("runs", "").split(",") if r]
        self.reply(await self.call(self.view.compare, runs))


class LogsHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        name = self.get_query_argument("name", None)
        text = await self.call(self.view.logs, run_id, name, self.tail())
        self.reply({"id": run_id, "name": name, "text": text})


class ActionHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def post(self, run_id: str, action: str) -> None:
        if action == "tensorboard":
            job = await self.call(self.view.job, run_id)
            url = await self.call(self.tensorboards.url, run_id, job.run_dir.tb_dir)
            self.reply({"id": run_id, "url": url})
            return
        if action == "cancel":
            self.reply(await self.call(self.view.cancel, run_id))
            return
        body = self.get_json_body() or {}
        if action == "export":
            if not isinstance(body, dict) or set(body) - {"formats", "quant"}:
                raise tornado.web.HTTPError(400, reason='the body must be {"formats": [...], '
                                            '"quant": [...]}')
            self.set_status(202)
            self.reply(await self.call(self.view.export, run_id, body))
            return
        option = {"deploy": "target", "resume": "budget_limit"}[action]
        if not isinstance(body, dict) or set(body) - {option}:
            raise tornado.web.HTTPError(400, reason=f'the body must be {{"{option}": ...}} or empty')
        method = {"deploy": self.view.deploy, "resume": self.view.resume}[action]
        self.reply(await self.call(method, run_id, body.get(option)))


class EndpointStopHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def post(self, name: str) -> None:
        self.reply(await self.call(self.view.stop_endpoint, name))


class CourseHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply(await self.call(course_panel))


class CourseGrantHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def post(self) -> None:
        self.reply(await self.call(course_grant, self.get_json_body()))


class NotebooksHandler(WorkbenchHandler):
    @tornado.web.authenticated
    async def post(self) -> None:
        body = self.get_json_body() or {}
        directory = str(body.get("directory", "")).strip("/")
        target = str(body.get("target") or "local")
        cm = self.contents_manager
        if ".." in directory.split("/") or not await ensure_async(cm.dir_exists(directory)):
            raise tornado.web.HTTPError(400, reason=f"no folder {directory!r} in the file browser")
        runs = body.get("runs")
        if runs is None:
            stem, content = "fine-tune.ipynb", new_run_notebook(target)
        else:
            if not isinstance(runs, list) or len(set(map(str, runs))) < 2:
                raise tornado.web.HTTPError(400, reason='"runs" must list two different run ids')
            for run_id in runs:  # exact ids of registered runs only (400 malformed, 404 unknown)
                await self.call(self.view.job, str(run_id))
            stem, content = "compare.ipynb", compare_notebook([str(r) for r in runs])
        name = await ensure_async(cm.increment_filename(stem, directory, insert="-"))
        path = f"{directory}/{name}" if directory else name
        model = {"type": "notebook", "format": "json", "content": content}
        await ensure_async(cm.save(model, path))
        self.set_status(201)
        self.reply({"path": path})


# Headers that describe one connection, not the message, and the ones the relay sets itself.
_NOT_RELAYED = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                "accept-encoding", "content-encoding", "cookie", "authorization"}


class TensorBoardProxyHandler(JupyterHandler):
    """A run's TensorBoard, relayed from its loopback port to the browser through Jupyter.

    Jupyter's authentication applies (token or login cookie). Its XSRF check does not: the
    TensorBoard page posts its own data queries (read-only, each with the ``X-XSRF-Protected``
    header TensorBoard itself demands), and it cannot know Jupyter's XSRF token.
    """

    def check_xsrf_cookie(self) -> None:
        return None

    @tornado.web.authenticated
    async def get(self, run_id: str, path: str) -> None:
        await self._relay(run_id)

    @tornado.web.authenticated
    async def post(self, run_id: str, path: str) -> None:
        await self._relay(run_id)

    async def _relay(self, run_id: str) -> None:
        port = self.settings["workbench_tensorboards"].port(run_id)
        if port is None:
            raise tornado.web.HTTPError(404, reason=f"no TensorBoard runs for {run_id}; open it "
                                                    "from the Runs panel (TensorBoard button)")
        headers = {k: v for k, v in self.request.headers.get_all()
                   if k.lower() not in _NOT_RELAYED}
        request = HTTPRequest(
            f"http://127.0.0.1:{port}{self.request.uri}", method=self.request.method,
            headers=headers, body=self.request.body if self.request.method == "POST" else None,
            follow_redirects=False, request_timeout=120)
        reply = await AsyncHTTPClient().fetch(request, raise_error=False)
        if reply.code == 599:  # no HTTP answer at all
            raise tornado.web.HTTPError(502, reason=f"TensorBoard for {run_id} did not answer: "
                                                    f"{reply.error}")
        self.set_status(reply.code, reply.reason)
        self.clear_header("Content-Type")
        for k, v in reply.headers.get_all():
            if k.lower() not in _NOT_RELAYED:
                self.add_header(k, v)
        self.finish(reply.body or b"")


def _finite(value: Any) -> Any:
    """NaN and infinities (a diverged loss) become null: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def routes(base_url: str) -> list[tuple[str, type[JupyterHandler]]]:
    api = url_path_join(base_url, "workbench", "api")
    run = rf"(?P<run_id>{RUN_ID_PATTERN})"
    return [
        (url_path_join(api, "runs"), RunsHandler),
        (url_path_join(api, "runs", run), RunHandler),
        (url_path_join(api, "runs", run, "logs"), LogsHandler),
        (url_path_join(api, "compare"), CompareHandler),
        (url_path_join(api, "runs", run, r"(?P<action>cancel|resume|deploy|export|tensorboard)"),
         ActionHandler),
        (url_path_join(api, "endpoints", rf"(?P<name>{RUN_ID_PATTERN})", "stop"), EndpointStopHandler),
        (url_path_join(api, "notebooks"), NotebooksHandler),
        (url_path_join(api, "course"), CourseHandler),
        (url_path_join(api, "course", "grant"), CourseGrantHandler),
        (url_path_join(base_url, "workbench", "tensorboard", run, "(?P<path>.*)"),
         TensorBoardProxyHandler),
    ]


def setup_handlers(server_app: Any) -> None:
    web_app = server_app.web_app
    tensorboards = TensorBoards(web_app.settings["base_url"])
    web_app.settings["workbench_view"] = RunsView(server_app.root_dir)
    web_app.settings["workbench_tensorboards"] = tensorboards
    web_app.add_handlers(".*$", routes(web_app.settings["base_url"]))
    import atexit

    atexit.register(tensorboards.stop_all)
