"""The endpoint handle: a running server's URL, models, chat/complete/generate, adapters, stop.

:class:`Endpoint` wraps one row of the registry's ``endpoints`` table and the endpoint folder
(``WORKBENCH_HOME/endpoints/NAME``); its serve target reaches the server, wherever it runs. A
handle belongs to one deployment (:mod:`workbench.serve.identity`): once its name is deployed
again, it refuses to act rather than act on the newer endpoint. :func:`refresh_state` corrects a
live state from the guard's files (healthy, or ended and how), and :func:`get_endpoint` /
:func:`endpoints` find endpoints again after a kernel restart.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from workbench.errors import DeployError, EndpointNotFoundError
from workbench.serve.checks import check_lora_rank
from workbench.serve.guard import _answers
from workbench.serve.identity import folder_is_of, own_record
from workbench.serve.server import _classify_failure, _last_log_line
from workbench.serve.sources import plan_serving
from workbench.serve.target import ServeTarget
from workbench.serve.targets import get_serve_target

LIVE_STATES = ("starting", "healthy")
_client_lock = threading.Lock()


# Written in an endpoint's folder by the meter paying for it (workbench.serve.metering): why it
# stopped the endpoint, and what the wallet still covers.
STOP_FILE = "stopped_because.json"
CREDIT_FILE = "credit.json"


def endpoints_dir() -> Path:
    from workbench.runs.home import home

    path = home() / "endpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Endpoint:
    """A running vLLM server: url, model names, chat/complete/generate, an OpenAI client, stop.

        >>> ep.chat("What does a cow say?", temperature=0)        # doctest: +SKIP
        'moo'
    """

    def __init__(self, record: Any, registry: Any = None) -> None:
        from workbench.runs.registry import Registry

        self.record = record
        self.registry = registry or Registry()
        self.dir = Path(record.endpoint_dir)
        self.serves: dict[str, Any] = json.loads(record.serves)
        key_file = self.dir / "api_key"
        self.api_key: str | None = key_file.read_text().strip() if key_file.is_file() else None
        self._http: Any = None
        self._target: ServeTarget | None = None

    name = property(lambda self: self.record.name)
    target = property(lambda self: self.record.target)
    # Where the server listens, as seen on its machine (an SSH host, a Slurm node).
    listen_url = property(lambda self: self.record.url)

    @property
    def serve_target(self) -> ServeTarget:
        if self._target is None:
            self._target = get_serve_target(self.record.target)
        return self._target

    @property
    def url(self) -> str:
        """http://host:port reachable from this process (an SSH tunnel when needed); API: /v1."""
        return self.serve_target.connect(self._own())

    @property
    def api_base(self) -> str:
        return self.url + "/v1"

    @property
    def models(self) -> list[str]:
        """Served model names: the base (or merged) model first, then one per adapter."""
        return list(self.serves["models"])

    @property
    def model(self) -> str:
        """The default model of requests: the (last added) fine-tuned one."""
        return self.models[-1] if self.serves.get("adapters") else self.models[0]

    @property
    def state(self) -> str:
        """This deployment's state, refreshed from its processes."""
        self.record = own_record(self.record, refresh_state(self.name, self.registry))
        return str(self.record.state)

    def _own(self) -> Any:
        """This deployment's registry row, read again; EndpointReplacedError once the name (row
        or folder) belongs to a newer deployment: a handle acts only on its own endpoint."""
        self.record = own_record(self.record, self.registry.get_endpoint(self.name))
        return self.record

    def _write(self, **fields: Any) -> None:
        """Record ``fields`` on this deployment's row (never on a newer endpoint of the name)."""
        self.registry.update_endpoint(self.name, deployment=self.record.deployment, **fields)
        self._own()  # raises if the row was not (or is no longer) this deployment's

    def _shown(self) -> tuple[str, str]:
        """(url, state) for display; a handle whose endpoint is gone says so instead."""
        try:
            return self.api_base, self.state
        except EndpointNotFoundError:
            return self.listen_url, "replaced by a newer deployment of the name, or removed"

    def money_note(self) -> str | None:
        """Why a meter stopped the endpoint, or what the wallet still covers of it (with a
        warning once that is short): written in its folder by :mod:`workbench.serve.metering`."""
        try:
            return str(json.loads((self.dir / STOP_FILE).read_text())["reason"]).join(
                ("stopped: ", ""))
        except (OSError, ValueError, KeyError):
            pass
        try:
            note = json.loads((self.dir / CREDIT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return note.get("warning") or (
            f"the wallet covers about {note['seconds_left'] / 60:.0f} more minute(s)")

    def __repr__(self) -> str:
        url, state = self._shown()
        note = self.money_note()
        return (f"<Endpoint {self.name} {url} {state} serving {', '.join(self.models)}"
                + (f"; {note}" if note else "") + ">")

    def _repr_html_(self) -> str:
        import html

        url, state = self._shown()
        rows = {"name": self.name, "target": self.target, "url": url,
                "listens on": self.listen_url, "state": state,
                "models": ", ".join(self.models), "base": self.serves.get("model"),
                "api key": "required" if self.api_key else "none (loopback)",
                "money": self.money_note()}
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th>"
                        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
                        for k, v in rows.items() if v is not None)
        return f"<table>{cells}</table>"

    # -- HTTP ------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _client(self) -> Any:
        import httpx

        with _client_lock:  # generate() calls this from many threads at once
            if self._http is None:
                self._http = httpx.Client(base_url=self.api_base, headers=self._headers(),
                                          timeout=httpx.Timeout(300.0, connect=10.0))
            return self._http

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self._client().post(path, json=body)
        if resp.status_code != 200:
            raise DeployError(f"{self.name}: {path} answered {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json())

    def healthy(self) -> bool:
        return _answers(self.url + "/health", timeout=2.0)

    def list_models(self) -> list[str]:
        """The model ids the server itself reports (GET /v1/models)."""
        resp = self._client().get("/models")
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]

    def chat(self, messages: str | list[dict[str, str]], model: str | None = None,
             temperature: float = 0.0, max_tokens: int = 64, stream: bool = False,
             **params: Any) -> Any:
        """One chat completion: a reply string, or with ``stream=True`` an iterator of text pieces.

        ``messages`` is a user prompt or OpenAI-style ``[{"role", "content"}, ...]``; the run's
        chat template renders it, exactly as in training. ``temperature=0`` is greedy.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"model": model or self.model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, **params}
        if stream:
            return self._stream("/chat/completions", body, lambda c: c["delta"].get("content"))
        return str(self._post("/chat/completions", body)["choices"][0]["message"]["content"])

    def complete(self, prompt: str, model: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 64, stream: bool = False, **params: Any) -> Any:
        """A raw text completion (no chat template): a string, or an iterator with ``stream``."""
        body = {"model": model or self.model, "prompt": prompt, "temperature": temperature,
                "max_tokens": max_tokens, **params}
        if stream:
            return self._stream("/completions", body, lambda c: c.get("text"))
        return str(self._post("/completions", body)["choices"][0]["text"])

    def _stream(self, path: str, body: dict[str, Any], piece: Any) -> Iterator[str]:
        with self._client().stream("POST", path, json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                resp.read()
                raise DeployError(f"{self.name}: {path} answered {resp.status_code}: "
                                  f"{resp.text[:500]}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                for choice in json.loads(data).get("choices", []):
                    text = piece(choice)
                    if text:
                        yield text

    def generate(self, prompts: Sequence[str], model: str | None = None, max_new_tokens: int = 16,
                 concurrency: int = 16) -> list[str]:
        """Greedy single-turn replies, like :meth:`workbench.serve.infer.ChatModel.generate`.

        Requests go out concurrently so vLLM batches them; ``teaching.score(ep.generate)`` works.
        """
        from concurrent.futures import ThreadPoolExecutor

        def one(p: str) -> str:
            return str(self.chat(p, model=model, temperature=0.0, max_tokens=max_new_tokens)).strip()

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, prompts))

    __call__ = generate

    def generate_token_ids(self, prompts: Sequence[str], model: str | None = None,
                           max_new_tokens: int = 16, concurrency: int = 16,
                           ) -> list[tuple[list[int], list[int]]]:
        """(prompt token ids, generated token ids) per prompt, greedy: for exact comparisons.

        Text can hide differences (a detokenizer holds back half a UTF-8 character); ids cannot.
        """
        from concurrent.futures import ThreadPoolExecutor

        def one(p: str) -> tuple[list[int], list[int]]:
            out = self._post("/chat/completions", {
                "model": model or self.model, "messages": [{"role": "user", "content": p}],
                "temperature": 0.0, "max_tokens": max_new_tokens, "return_token_ids": True})
            return list(out.get("prompt_token_ids") or []), list(out["choices"][0]["token_ids"])

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, prompts))

    def client(self) -> Any:
        """An ``openai.OpenAI`` client bound to this endpoint (needs the ``openai`` package)."""
        try:
            from openai import OpenAI
        except ImportError:
            raise DeployError("the OpenAI client needs the openai package: pip install openai; "
                              "ep.chat()/ep.complete() work without it") from None
        return OpenAI(base_url=self.api_base, api_key=self.api_key or "EMPTY")

    # -- adapters at run time --------------------------------------------------------------------
    def add_adapter(self, source: Any, name: str | None = None) -> str:
        """Load one more LoRA adapter (a run or an adapter folder) into the running server."""
        self._own()
        plan = plan_serving([source])
        if not plan.adapters:
            raise DeployError(f"{source} is not a LoRA adapter; only adapters can be added")
        a = plan.adapters[0]
        a.name = name or a.name
        if not self.serves.get("adapters") and not self.serves.get("max_lora_rank"):
            raise DeployError(f"endpoint {self.name} was started without LoRA support; deploy the "
                              "adapter together with the base model instead")
        if a.base != self.serves.get("model"):
            raise DeployError(f"adapter {a.name!r} belongs to base {a.base}, but {self.name} serves "
                              f"{self.serves.get('model')}; deploy it on its own endpoint")
        check_lora_rank([a], int(self.serves["max_lora_rank"]))
        if a.name in self.models:
            raise DeployError(f"{self.name} already serves a model named {a.name!r}; pass name=")
        resp = self._client().post("/load_lora_adapter",
                                   json={"lora_name": a.name, "lora_path": str(a.path)})
        if resp.status_code != 200:
            raise DeployError(f"{self.name} refused adapter {a.name!r}: {resp.text[:500]}")
        self.serves["models"].append(a.name)
        self.serves["adapters"][a.name] = str(a.path)
        self._write(serves=json.dumps(self.serves))
        return a.name

    # -- lifecycle -------------------------------------------------------------------------------
    def logs(self, tail: int | None = 50) -> str:
        self.serve_target.sync_log(self.record)
        text = (self.dir / "server.log").read_text(encoding="utf-8", errors="replace") if (
            self.dir / "server.log").is_file() else ""
        lines = text.splitlines()
        return "\n".join(lines[-tail:] if tail else lines)

    def stop(self, timeout: float = 60.0) -> str:
        """Stop the server and its guard; the registry records 'stopped' once they are gone.

        Only this handle's own deployment is stopped: once its name belongs to a newer endpoint,
        EndpointReplacedError, and nothing is stopped or written. DeployError when its processes
        still run ``timeout`` s later (or their machine cannot say), with nothing recorded.
        """
        self._end(self._own(), timeout)
        self._write(state="stopped")
        return "stopped"

    def _end(self, record: Any, timeout: float) -> None:
        """Stop ``record``'s processes and wait until its target sees them gone."""
        target = self.serve_target
        target.stop(record)
        if self._http is not None:
            self._http.close()
            self._http = None
        deadline = time.time() + timeout
        while target.alive(record):  # a Slurm job may be COMPLETING for a while after scancel
            if time.time() > deadline:
                raise DeployError(
                    f"endpoint {self.name}: its processes on {record.target} still run {timeout:.0f}"
                    f" s after being told to stop, or {record.target} cannot say; it stays "
                    f"recorded {record.state}. Run ep.stop() (`workbench undeploy {self.name}`) "
                    f"again, or end them by hand (guard or job {record.pid}, server pid "
                    f"{record.server_pid})")
            time.sleep(0.5)

    def chat_widget(self, **kw: Any) -> Any:
        """A notebook chat: conversation, temperature, max tokens, streamed tokens."""
        from workbench.widgets.chat import ChatWidget

        return ChatWidget(self, **kw)

    show = chat_widget

    def wait_healthy(self, timeout: float = 600.0, progress: bool = True) -> Endpoint:
        """Block until /health answers; raise EndpointStartError (and stop it) if it dies."""
        from tqdm.auto import tqdm

        target = self.serve_target
        start = time.time()
        bar = tqdm(desc=f"starting {self.name}", bar_format="{desc}: {elapsed} {postfix}",
                   disable=not progress)
        try:
            while True:
                listening = target.address(self.record)
                if listening and listening != self.record.url:  # a remote port, a Slurm node
                    pid = target.read(self.record, "server.pid").strip()
                    self._write(url=listening, server_pid=int(pid) if pid.isdigit()
                                else self.record.server_pid)
                if listening and self.healthy():
                    self._write(state="healthy")
                    return self
                if not target.alive(self.record):
                    self._fail(None)
                if time.time() - start > timeout:
                    self._fail(f"not healthy after {timeout:.0f} s")
                target.sync_log(self.record)
                bar.set_postfix_str(target.note(self.record) or _last_log_line(
                    self.dir / "server.log"), refresh=True)
                time.sleep(0.25)
        finally:
            bar.close()

    def _fail(self, why: str | None) -> None:
        try:
            self._end(self._own(), 60.0)
        except DeployError:
            pass  # still running: not recorded failed (stop() can end it); the start error says why
        else:
            self._write(state="failed")
        log = self.logs(tail=None)
        raise _classify_failure(self.name, log, why) from None


# -- the registry's view ---------------------------------------------------------------------------
def refresh_state(name: str, registry: Any = None) -> Any:
    """The endpoint's record, with a live state corrected once its processes (the guard and the
    server) have all gone: a server whose guard was killed still counts as live."""
    from workbench.runs.registry import Registry

    registry = registry or Registry()
    record = registry.get_endpoint(name)
    target = get_serve_target(record.target) if record.state in LIVE_STATES else None
    # A newer deploy of the name may be rewriting the folder: its files say nothing of this row.
    own_folder = folder_is_of(record)
    if target is not None and record.state == "starting" and own_folder and target.read(
            record, "healthy.json"):
        # Its guard saw /health answer: up, even if nobody waited for it (deploy(wait=False)).
        registry.update_endpoint(name, deployment=record.deployment, state="healthy",
                                 url=target.address(record) or record.url)
        record = registry.get_endpoint(name)
    if target is not None and record.state in LIVE_STATES and not target.alive(record):
        try:
            ended = json.loads(target.read(record, "exit.json") or b"{}") if own_folder else {}
        except json.JSONDecodeError:
            ended = {}
        state = "stopped" if ended.get("reason") in ("signal", "watched process ended") else "failed"
        registry.update_endpoint(name, deployment=record.deployment, state=state)
        record = registry.get_endpoint(name)
    return record


def get_endpoint(name: str, registry: Any = None) -> Endpoint:
    """An endpoint by name (e.g. after a kernel restart)."""
    from workbench.runs.registry import Registry

    registry = registry or Registry()
    return Endpoint(refresh_state(name, registry), registry)


def endpoints(all: bool = False, registry: Any = None) -> list[Endpoint]:
    """Endpoints in the registry, newest first: live ones, or every one with ``all=True``."""
    from workbench.runs.registry import Registry

    registry = registry or Registry()
    out = [Endpoint(refresh_state(r.name, registry), registry) for r in registry.list_endpoints()]
    return out if all else [e for e in out if e.record.state in LIVE_STATES]


def undeploy(name: str, registry: Any = None) -> str:
    """Stop the endpoint called ``name`` (whichever deployment of it is current)."""
    return get_endpoint(name, registry).stop()


def endpoints_table(eps: Sequence[Endpoint]) -> str:
    # The URL where each server listens (on its host or node): listing opens no tunnels.
    rows = [("NAME", "TARGET", "STATE", "API (WHERE IT LISTENS)", "MODELS")]
    rows += [(e.name, e.target, e.record.state, f"{e.listen_url}/v1", ", ".join(e.models))
             for e in eps]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
