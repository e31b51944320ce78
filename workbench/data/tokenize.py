"""Turn prepared examples into training tokens: chat template, loss on responses only, truncation.

Labels are -100 everywhere except on the assistant turns (including the end-of-turn token, so the
model learns to stop). Spans are found on the rendered text and mapped to tokens through the fast
tokenizer's offsets (:mod:`workbench.data.token_spans`), which works for any chat template without
knowing its markers.

Truncation keeps what is trained. ``keep_response`` (the default) gives the response at least half
of ``max_length`` (all of it if it fits), and the prompt keeps its *end* (the part next to the
answer, with the assistant marker) plus a leading BOS. A conversation with several assistant
turns first loses whole exchanges, oldest first, keeping its system turn, and every assistant
turn that remains is trained. ``right`` cuts the end, as tokenizers do,
and may cut the whole response away. An example with no trained token left is reported as
dropped by :mod:`workbench.data.tokenized`, never silently lost.

    >>> enc = encode_batch([{"text": "hello"}], tokenizer, 64)[0]  # doctest: +SKIP
    >>> enc.labels == enc.input_ids
    True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Packing and the collator live in workbench.data.batches; callers may import them from here.
from workbench.data.batches import IGNORE
from workbench.data.batches import Collator as Collator
from workbench.data.batches import pack as pack
from workbench.data.token_spans import Tokens, encode_texts, span_labels

if TYPE_CHECKING:
    from workbench.spec import RunSpec


# Used when a base model's tokenizer has no chat template of its own; saved with the artefacts so
# serving renders prompts exactly as training did.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '### ' + m['role'] + ':\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


def load_tokenizer(spec: RunSpec, source: str) -> Any:
    """The run's tokenizer from ``source`` (a folder or hub id), with a chat template ensured."""
    tok = _builtin_tokenizer(spec, source)
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, revision=spec.model.revision,
                                            trust_remote_code=spec.model.trust_remote_code)
    ensure_chat_template(tok)
    return tok


def _builtin_tokenizer(spec: RunSpec, source: str) -> Any:
    """A built-in model's tokenizer without AutoTokenizer, or None for any other model.

    The built-in models save a plain ``tokenizers`` file whose class AutoTokenizer resolves to
    ``TokenizersBackend``; importing that class alone spares a launch that tokenises the import
    of AutoTokenizer's model registry (figures in docs/benchmarks-data.md). Other models keep
    AutoTokenizer, whose choice of class depends on their config.
    """
    from workbench.spec.models import is_builtin

    config = Path(source) / "tokenizer_config.json"
    if not is_builtin(spec.model.id) or not config.is_file():
        return None
    if json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") != \
            "TokenizersBackend":
        return None
    try:
        from transformers import TokenizersBackend
    except ImportError:  # a transformers before 5: AutoTokenizer
        return None
    return TokenizersBackend.from_pretrained(source)


def ensure_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


@dataclass
class Encoded:
    """One tokenised example, with its lengths *before* truncation (for statistics)."""

    input_ids: list[int]
    labels: list[int]
    prompt_tokens: int  # tokens before the first trained token
    response_tokens: int  # tokens from the first trained token to the end
    truncated: bool

    @property
    def trainable(self) -> int:
        return len(self.labels) - self.labels.count(IGNORE)  # list.count: C speed, per example


def _render(tokenizer: Any, messages: list[dict[str, str]], **kw: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


class ChatRenderer:
    """Renders conversations and the character spans of their assistant turns.

    Rendering a Jinja template three times per example is most of the cost on a large set, so
    the template is rendered once per sequence of roles with placeholder contents, and real
    contents are spliced in. That is only exact when the template inserts contents verbatim: the
    placeholders carry edge whitespace (so a template that strips or trims loses them and is
    detected), and the first examples of each role sequence are checked against a real render;
    any mismatch sends that role sequence to the plain (slow, always exact) path.
    """

    _CHECKS = 4

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._layouts: dict[tuple[str, ...], Any] = {}
        self._checked: dict[tuple[str, ...], int] = {}

    def render(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        roles = tuple(m["role"] for m in messages)
        if roles not in self._layouts:
            self._layouts[roles] = self._layout(roles)
        layout = self._layouts[roles]
        if layout is None:
            return self._slow(messages)
        text, spans = self._splice(layout, [m["content"] for m in messages])
        if self._checked.get(roles, 0) < self._CHECKS:
            self._checked[roles] = self._checked.get(roles, 0) + 1
            if (text, spans) != self._slow(messages):
                self._layouts[roles] = None
                return self._slow(messages)
        return text, spans

    def _slow(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        full = _render(self.tok, messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start = len(_render(self.tok, messages[:i], add_generation_prompt=True))
                spans.append((start, len(_render(self.tok, messages[: i + 1]))))
        return full, spans

    def _layout(self, roles: tuple[str, ...]) -> Any:
        marks = [f" \n\u2063wb{i}\u2063\n " for i in range(len(roles))]
        msgs = [{"role": r, "content": s} for r, s in zip(roles, marks)]
        try:
            full, spans = self._slow(msgs)
        except Exception:  # a template that rejects the placeholder: the plain path will say why
            return None
        pieces, at = [], 0
        for mark in marks:
            k = full.find(mark, at)
            if k < 0 or full.count(mark) != 1:
                return None
            pieces.append((at, k))
            at = k + len(mark)
        pieces.append((at, len(full)))
        bounds = [b for span in spans for b in span]
        # A span boundary inside a placeholder means the template cuts contents: not spliceable.
        if any(a < b < a + len(mark) for b in bounds for (_, a), mark in zip(pieces, marks)):
            return None
        return full, pieces, marks, spans

    @staticmethod
    def _splice(layout: Any, contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
        full, pieces, marks, spans = layout
        out, shift_at = [], []  # shift_at: (position in the layout, length change after it)
        shift = 0
        for (a, b), content, mark in zip(pieces, contents, marks):
            out += [full[a:b], content]
            shift += len(content) - len(mark)
            shift_at.append((b + len(mark), shift))
        a, b = pieces[-1]
        out.append(full[a:b])

        def moved(pos: int) -> int:
            delta = 0
            for end, total in shift_at:
                if pos >= end:
                    delta = total
            return pos + delta

        return "".join(out), [(moved(s), moved(e)) for s, e in spans]


def encode_batch(examples: Sequence[dict[str, Any]], tokenizer: Any, max_length: int,
                 truncation: str = "keep_response",
                 renderer: ChatRenderer | None = None) -> list[Encoded]:
    """Tokenise a batch (one call into the Rust tokenizer per batch) and truncate each example."""
    renderer = renderer or ChatRenderer(tokenizer)
    rendered = render_batch(examples, tokenizer, renderer)
    return finish_batch(rendered, encode_rendered(tokenizer, rendered), tokenizer, max_length,
                        truncation, renderer)


@dataclass
class Rendered:
    """A batch's texts, ready for the tokenizer: chats (index, text, assistant spans) and plain
    texts (index, text). The three stages are apart so the Rust encode of one batch, which
    releases the GIL, can run while Python finishes the previous one (workbench.data.tokenized).
    """

    examples: Sequence[dict[str, Any]]
    chats: list[tuple[int, str, list[tuple[int, int]]]]
    texts: list[tuple[int, str]]


def render_batch(examples: Sequence[dict[str, Any]], tokenizer: Any,
                 renderer: ChatRenderer) -> Rendered:
    chats = [(i, *renderer.render(ex["messages"])) for i, ex in enumerate(examples)
             if "text" not in ex]
    texts = [(i, ex["text"] + tokenizer.eos_token) for i, ex in enumerate(examples) if "text" in ex]
    return Rendered(examples, chats, texts)


def encode_rendered(tokenizer: Any, rendered: Rendered) -> tuple[list[Tokens], list[Tokens]]:
    """The Rust tokenizer's encodings of a rendered batch: (chats, texts)."""
    # The template already carries BOS where the model wants it: no special tokens for chats.
    chats = encode_texts(tokenizer, [t for _, t, _ in rendered.chats], False) if rendered.chats else []
    texts = encode_texts(tokenizer, [t for _, t in rendered.texts], True) if rendered.texts else []
    return chats, texts


def finish_batch(rendered: Rendered, encoded: tuple[list[Tokens], list[Tokens]],
                 tokenizer: Any, max_length: int, truncation: str,
                 renderer: ChatRenderer) -> list[Encoded]:
    """Labels and truncation for an encoded batch, in the batch's order."""
    examples = rendered.examples
    out: list[Encoded | None] = [None] * len(examples)
    for (i, _), tokens in zip(rendered.texts, encoded[1]):
        ids = tokens.ids
        out[i] = _truncate(ids, list(ids), 0, max_length, truncation, None)
    bos = tokenizer.bos_token_id
    for (i, text, spans), tokens in zip(rendered.chats, encoded[0]):
        ids = tokens.ids
        labels, first = span_labels(ids, tokens, text, spans)
        if len(ids) > max_length and truncation == "keep_response" and len(spans) > 1:
            out[i] = _drop_old_turns(examples[i]["messages"], ids, labels, tokenizer,
                                     renderer, max_length, bos)
            continue
        out[i] = _truncate(ids, labels, first, max_length, truncation, bos)
    return [e for e in out if e is not None]


def _first_trained(labels: list[int]) -> int:
    for k, lab in enumerate(labels):  # a plain loop: cheaper per row than a generator
        if lab != IGNORE:
            return k
    return len(labels)


def _drop_old_turns(messages: list[dict[str, str]], ids: list[int], labels: list[int],
                    tokenizer: Any, renderer: ChatRenderer, limit: int,
                    bos: int | None) -> Encoded:
    """A conversation too long for ``limit``: keep the system turns and the latest exchanges.

    Whole exchanges (a user turn and the assistant's answer) go first, oldest first, until the
    rest fits or one exchange is left; that one is then cut like a single-turn example (the
    prompt's start first). Every assistant turn that is kept stays trained. Lengths in the
    result are those of the whole conversation, for the statistics.
    """
    first = _first_trained(labels)
    prompt, response = first, len(ids) - first
    lead = [m for m in messages if m["role"] == "system"][:1] if messages[0]["role"] == "system" \
        else []
    rest = list(messages[len(lead):])
    text, tokens = "", None
    while sum(m["role"] == "assistant" for m in rest) > 1:
        oldest = next(k for k, m in enumerate(rest) if m["role"] == "assistant")
        rest = rest[oldest + 1:]
        text, spans = renderer.render(lead + rest)
        tokens = encode_texts(tokenizer, [text], False)[0]
        ids = tokens.ids
        labels, _ = span_labels(ids, tokens, text, spans)
        if len(ids) <= limit:
            break
    head = None
    if lead and tokens is not None and len(ids) > limit:
        # One exchange left and still too long: its user turn loses its start, the system turn
        # stays (where the template renders it first, as a prefix of the conversation).
        system = _render(tokenizer, lead)
        if text.startswith(system):
            head = tokens.first_from(len(system))
    cut = _truncate(ids, labels, _first_trained(labels), limit, "keep_response", bos, head)
    return Encoded(cut.input_ids, cut.labels, prompt, response, True)


def _truncate(ids: list[int], labels: list[int], first: int, limit: int, mode: str,
              bos: int | None, keep_head: int | None = None) -> Encoded:
    n = len(ids)
    prompt, response = first, n - first
    if n <= limit:
        return Encoded(ids, labels, prompt, response, False)
    if mode == "right" or first == 0:
        return Encoded(ids[:limit], labels[:limit], prompt, response, True)
    keep_response = min(response, max(limit - prompt, limit // 2))
    keep_prompt = limit - keep_response
    head = 1 if (bos is not None and ids[0] == bos and keep_prompt > 0) else 0
    if keep_head is not None and head <= keep_head <= keep_prompt // 2:
        head = keep_head  # a system turn, when it leaves at least as much of the question
    tail = range(first - (keep_prompt - head), first)
    idx = list(range(head)) + list(tail) + list(range(first, first + keep_response))
    return Encoded([ids[k] for k in idx], [labels[k] for k in idx], prompt, response, True)


def tokenize_example(example: dict[str, Any], tokenizer: Any, max_length: int,
                     truncation: str = "keep_response") -> dict[str, list[int]]:
    enc = encode_batch([example], tokenizer, max_length, truncation)[0]
    return {"input_ids": enc.input_ids, "labels": enc.labels}
