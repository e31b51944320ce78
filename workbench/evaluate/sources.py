"""Model sources: what a scorer asks for answers and log-likelihoods, whatever holds the weights.

A source is weights in this process (:class:`TransformersSource`: a base model id or folder, a
run's adapter/model folder, a snapshot folder, or the live model of a training run) or an
OpenAI-compatible endpoint (:class:`EndpointSource`: a Workbench endpoint name or any URL).
Both answer chat prompts greedily, so their scores are comparable (a vision-language model's
weights are :class:`workbench.evaluate.images.VisionSource`, found by :func:`locate_weights`).
A vLLM server gets a batch of prompts as ONE request (its /v1/chat/completions/batch: the same
rendering and sampling as its chat completions, less work per prompt); any other server gets one
chat completion per prompt.

    >>> src = open_weights("builtin:tiny-llama")                        # doctest: +SKIP
    >>> src.generate([[{"role": "user", "content": "What does a cow say?"}]])  # doctest: +SKIP
    ['moo']
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

from workbench.errors import EvalError, JudgeError

Messages = list[dict[str, str]]
# Prompts an EndpointSource has the server hold at once: chat requests in flight, or
# conversations per batch request (vLLM). vLLM batches what it holds (continuous batching), so an
# evaluation's prompts go out together: 64 is heldout's default max_samples, one batch. A hosted
# API with tight rate limits may want fewer (``concurrency=``).
CONCURRENCY = 64


class TransformersSource:
    """Weights in this process (``model``: a transformers or peft model; ``label``: base | run)."""

    kind = "transformers"

    def __init__(self, model: Any, tokenizer: Any, label: str = "run", base_id: str | None = None,
                 batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.label = model, tokenizer, label
        self.base_id = base_id  # what the weights were trained from (for a judge's baseline)
        self.batch_size = batch_size
        self._adapters_off = False

    def __repr__(self) -> str:
        return f"TransformersSource({self.label})"

    @contextmanager
    def inference(self) -> Iterator[None]:
        """Eval mode and no gradients, put back as they were (the live model of a run trains on)."""
        import torch

        was_training = self.model.training
        self.model.eval()
        off = self.model.disable_adapter() if self._adapters_off else nullcontext()
        try:
            with torch.no_grad(), off:
                yield
        finally:
            if was_training:
                self.model.train()

    def _encode(self, prompts: Sequence[Messages]) -> Any:
        """Tokens of a batch of prompts with the assistant's turn opened, padded on the
        tokenizer's side."""
        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m in prompts]
        return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def generate(self, prompts: Sequence[Messages], max_new_tokens: int = 32) -> list[str]:
        tok = self.tokenizer
        side = tok.padding_side
        tok.padding_side = "left"  # decoder-only generation wants each prompt flush right
        device = next(self.model.parameters()).device
        out: list[str] = []
        try:
            with self.inference():
                for i in range(0, len(prompts), self.batch_size):
                    enc = self._encode(prompts[i:i + self.batch_size]).to(device)
                    gen = self.model.generate(**enc, max_new_tokens=max_new_tokens,
                                              do_sample=False, pad_token_id=tok.pad_token_id)
                    new = gen[:, enc["input_ids"].shape[1]:]
                    out += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
        finally:
            tok.padding_side = side
        return out

    def baseline(self) -> TransformersSource | None:
        """The base model's answers, for a judge: the same weights with the LoRA adapter off
        (no second copy in memory); None for full fine-tunes (the base is loaded by the caller)."""
        if self.label == "base":
            return None
        if hasattr(self.model, "disable_adapter"):
            twin = copy.copy(self)  # the same weights and tokenizer, answering as the base
            twin.label, twin._adapters_off = "base", True
            return twin
        return self._open_base()

    def _open_base(self) -> TransformersSource | None:
        return open_weights(self.base_id, label="base") if self.base_id else None


class EndpointSource:
    """An OpenAI-compatible server (a Workbench endpoint or any URL), asked with temperature 0."""

    kind = "endpoint"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 label: str = "endpoint", concurrency: int = CONCURRENCY,
                 timeout: float = 120.0) -> None:
        from openai import OpenAI

        self.base_url = base_url.rstrip("/")
        self.label = label
        self.api_key = api_key
        # Retries hide an unreachable server for minutes; one retry covers a dropped connection.
        self.client = OpenAI(base_url=self.base_url, api_key=api_key or "none", max_retries=1,
                             timeout=timeout)
        self._model = model
        self.timeout = timeout
        self._vllm: bool | None = None  # whether the server is vLLM, asked once (/v1/models)
        if concurrency < 1:
            raise EvalError(f"concurrency {concurrency}: give at least 1 request in flight")
        self.concurrency = concurrency

    def __repr__(self) -> str:
        return f"EndpointSource({self.label} {self.base_url})"

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._call(lambda: self.client.models.list().data[0].id)
        return self._model

    def _call(self, fn: Any) -> Any:
        import openai

        try:
            return fn()
        except openai.APIConnectionError as exc:
            raise JudgeError(f"cannot reach {self.base_url} ({exc}); check the URL and that the "
                             "server is running (`workbench endpoints`)") from None
        except openai.APIStatusError as exc:
            raise JudgeError(f"{self.base_url} refused the request: HTTP {exc.status_code} "
                             f"{str(exc)[:300]}; check the model name and the API key") from None

    def chat(self, messages: Messages, max_new_tokens: int = 32) -> str:
        def ask() -> Any:
            return self.client.chat.completions.create(model=self.model, messages=messages,  # type: ignore[arg-type]
                                                       temperature=0.0, max_tokens=max_new_tokens)

        reply = self._call(ask)
        try:
            content = reply.choices[0].message.content if reply.choices else ""
        except (AttributeError, TypeError, IndexError, KeyError):
            content = None  # a body that is not a chat completion (an HTML page, other JSON)
        else:
            if content is None or isinstance(content, str):
                return (content or "").strip()
        raise JudgeError(f"{self.base_url} answered with something that is not an OpenAI chat "
                         f"completion ({str(reply)[:200]!r}); give the base URL of an "
                         "OpenAI-compatible server, ending in /v1")

    def is_vllm(self) -> bool:
        """Whether the server is vLLM: its /v1/models says ``owned_by: vllm`` (a GET, so a server
        that only offers chat sees nothing else)."""
        if self._vllm is None:
            listed = self._call(lambda: self.client.models.list().data)
            self._vllm = bool(listed) and all(getattr(m, "owned_by", None) == "vllm"
                                              for m in listed)
        return self._vllm

    def generate(self, prompts: Sequence[Messages], max_new_tokens: int = 32) -> list[str]:
        """Greedy answers, in the order of ``prompts``. A vLLM server gets them ``concurrency``
        at a time in one batch request (:meth:`_batched`); any other server, or a vLLM without
        the batch route, gets chat requests, up to ``concurrency`` in flight."""
        _ = self.model  # resolve the model name (and reachability) once, before the threads
        if prompts and self.is_vllm():
            answers = self._batched(prompts, max_new_tokens)
            if answers is not None:
                return answers
        return self._chats(prompts, max_new_tokens)

    def _batched(self, prompts: Sequence[Messages], max_new_tokens: int) -> list[str] | None:
        """``concurrency`` conversations per request to vLLM's /v1/chat/completions/batch: the
        same chat rendering and sampling as its chat completions, one HTTP request, one JSON
        answer and one request's handling for a whole batch instead of one per prompt. None
        when the server lacks the route (vLLM before 0.32): the caller asks one by one."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out: list[str] = []
        with httpx.Client(timeout=self.timeout, headers=headers) as http:
            for i in range(0, len(prompts), self.concurrency):
                chunk = list(prompts[i:i + self.concurrency])
                try:
                    r = http.post(f"{self.base_url}/chat/completions/batch", json={
                        "model": self.model, "messages": chunk, "temperature": 0.0,
                        "max_tokens": max_new_tokens})
                except httpx.HTTPError as exc:
                    raise JudgeError(f"cannot reach {self.base_url} ({exc}); check the URL and "
                                     "that the server is running (`workbench endpoints`)") from None
                if r.status_code in (404, 405) and not out:
                    return None
                if r.status_code != 200:
                    raise JudgeError(f"{self.base_url} refused the request: HTTP {r.status_code} "
                                     f"{r.text[:300]}; check the model name and the API key")
                try:
                    texts = {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
                except (ValueError, KeyError, TypeError):
                    texts = {}
                if sorted(texts) != list(range(len(chunk))):
                    raise JudgeError(f"{self.base_url} answered a batch of {len(chunk)} "
                                     f"conversations with {r.text[:200]!r}; is it vLLM?")
                out += [(texts[j] or "").strip() for j in range(len(chunk))]
        return out

    def _chats(self, prompts: Sequence[Messages], max_new_tokens: int) -> list[str]:
        """One chat request per prompt, up to ``concurrency`` in flight (the server batches
        them); the first failure is raised and no more are sent."""
        pool = ThreadPoolExecutor(max(1, min(self.concurrency, len(prompts))))
        futures = [pool.submit(self.chat, m, max_new_tokens) for m in prompts]
        try:
            # Whichever request fails first, not the first prompt's: the error comes now, not
            # after the requests in flight (a hung server holds each for the whole timeout).
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and (exc := f.exception()) is not None:
                    raise exc
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # those not sent yet never are

    def baseline(self) -> None:
        return None  # an endpoint's base is not known here: a judge compares with references


def open_weights(source: str | Path, label: str = "run") -> TransformersSource:
    """Load a base model id/folder, a run's adapter/ or model/ folder, or a snapshot folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data.tokenize import ensure_chat_template

    where = locate_weights(source)
    model: Any = AutoModelForCausalLM.from_pretrained(where.base)
    if where.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(where.adapter))
    tok = AutoTokenizer.from_pretrained(str(where.tokenizer))
    ensure_chat_template(tok)
    return TransformersSource(model, tok, label, where.base_id)


class Weights(NamedTuple):
    """Where a source's weights are: ``base`` (a folder or hub id), the LoRA ``adapter`` folder
    on it (None: the weights are whole), the ``tokenizer`` folder and the ``base_id`` trained
    from (for a judge's baseline; None when not known)."""

    base: str
    adapter: Path | None
    tokenizer: Path
    base_id: str | None


def locate_weights(source: str | Path) -> Weights:
    """:class:`Weights` of a base model id/folder, a run's adapter/ or model/, or a snapshot."""
    from workbench.spec.models import resolve_model

    path = Path(str(source))
    if (path / "adapter_config.json").is_file():
        meta = _meta(path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        base = meta.get("base_model") or cfg["base_model_name_or_path"]
        if meta.get("base_model_id"):
            base = resolve_model(meta["base_model_id"])
        tok_dir = path if (path / "tokenizer_config.json").is_file() else Path(base)
        return Weights(str(base), path, tok_dir, meta.get("base_model_id") or base)
    resolved = resolve_model(str(source))
    base_id = _meta(path).get("base_model_id") if path.is_dir() else None
    return Weights(str(resolved), None, Path(resolved), base_id)


def _meta(path: Path) -> dict[str, Any]:
    f = path / "workbench.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def open_endpoint(name_or_url: str, model: str | None = None, api_key_env: str | None = None,
                  label: str | None = None, concurrency: int = CONCURRENCY) -> EndpointSource:
    """An endpoint by Workbench name (its URL, key and fine-tuned model) or by base URL, asked
    with up to ``concurrency`` requests in flight."""
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise EvalError(f"environment variable {api_key_env} (api_key_env) is not set; "
                            f"export it with the API key of {name_or_url}")
    if name_or_url.startswith(("http://", "https://")):
        return EndpointSource(name_or_url, model, key, label or f"endpoint:{name_or_url}",
                              concurrency)
    from workbench.runs.registry import Registry
    from workbench.serve.endpoint import Endpoint

    reg = Registry()
    ep = Endpoint(reg.get_endpoint(name_or_url), reg)
    return EndpointSource(ep.api_base, model or ep.model, key or ep.api_key,
                          label or f"endpoint:{name_or_url}", concurrency)
