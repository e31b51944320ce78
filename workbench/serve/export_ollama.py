"""The Ollama Modelfile written beside a GGUF export: the run's chat template and stop tokens.

Ollama's TEMPLATE is a Go template, not Jinja, so :func:`chat_parts` renders the run's own Jinja
chat template (through its tokenizer) around marker messages and cuts out what it puts before and
after each role's content and as the generation prompt; :func:`modelfile` writes those pieces as
a Go template, with the end-of-turn markers and the tokenizer's EOS as ``stop`` parameters.
:func:`render_parts` renders a conversation from the same pieces, so the export checks that they
give the same prompt text as the Jinja template on the run's own prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import ExportError

_MARK = {"system": "\ue000SYS\ue000", "user": "\ue000USR\ue000", "assistant": "\ue000AST\ue000"}


@dataclass
class ChatParts:
    """Text around each role's content, the generation prompt, and the stop strings."""

    before: dict[str, str]
    after: dict[str, str]
    generation: str
    lead: str = ""  # what the template writes once at the start (often the BOS token)
    stops: list[str] = field(default_factory=list)


def _render(tok: Any, messages: list[dict[str, str]], gen: bool) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen))


def chat_parts(tok: Any) -> ChatParts:
    """Cut the tokenizer's chat template into per-role pieces; refuse a template whose turns
    depend on more than their role and content (those need a hand-written TEMPLATE)."""
    u, a = _MARK["user"], _MARK["assistant"]
    pair = _render(tok, [{"role": "user", "content": u}, {"role": "assistant", "content": a}], False)
    asked = _render(tok, [{"role": "user", "content": u}], True)
    if pair.count(u) != 1 or pair.count(a) != 1 or asked.count(u) != 1:
        raise ExportError("the chat template does not write each message's content once; "
                          "write the Ollama TEMPLATE by hand")
    head, rest = pair.split(u)
    user_after, rest = rest.split(a)
    lead = ""
    bos = getattr(tok, "bos_token", None) or ""
    if bos and head.startswith(bos):
        lead, head = bos, head[len(bos):]
    # The user turn's close is what follows it alone; the rest is the assistant turn's opening.
    user_close = _render(tok, [{"role": "user", "content": u}], False).split(u, 1)[1]
    asked_tail = asked.split(u, 1)[1]
    if not (user_after.startswith(user_close) and asked_tail.startswith(user_close)):
        raise ExportError("the chat template's user turn ends differently before an answer; "
                          "write the Ollama TEMPLATE by hand")
    assistant_open = user_after[len(user_close):]
    generation = asked_tail[len(user_close):]
    assistant_close = rest
    before = {"user": head, "assistant": assistant_open}
    after = {"user": user_close, "assistant": assistant_close}
    try:
        s = _MARK["system"]
        sys_text = _render(tok, [{"role": "system", "content": s},
                                 {"role": "user", "content": u}], False)
        if sys_text.count(s) == 1:
            sys_head, sys_rest = sys_text.split(s)
            sys_after = sys_rest.split(u)[0]
            if sys_head.startswith(lead):
                sys_head = sys_head[len(lead):]
            if sys_after.endswith(head):
                before["system"], after["system"] = sys_head, sys_after[:len(sys_after) - len(head)]
    except Exception:  # noqa: BLE001 - a template without a system role: none in the Modelfile
        pass
    stops = []
    eos = getattr(tok, "eos_token", None)
    close = assistant_close.strip()
    if close:
        stops.append(close)
    if eos and eos not in stops:
        stops.append(str(eos))
    if before["user"].strip() and before["user"].strip() not in stops:
        stops.append(before["user"].strip())  # the model starting the next user turn
    return ChatParts(before, after, generation, lead, stops)


def render_parts(parts: ChatParts, messages: Sequence[dict[str, str]], gen: bool,
                 with_lead: bool = True) -> str:
    """A conversation rendered from ``parts`` (what the Modelfile's TEMPLATE renders)."""
    text = parts.lead if with_lead else ""
    for m in messages:
        text += parts.before.get(m["role"], "") + m["content"] + parts.after.get(m["role"], "")
    if gen and (not messages or messages[-1]["role"] != "assistant"):
        text += parts.generation
    return text


def _go(text: str) -> str:
    if "{{" in text or '"""' in text:
        raise ExportError(f"the chat template writes {text!r}, which a Modelfile TEMPLATE cannot "
                          "hold as text; write the TEMPLATE by hand")
    return text


def modelfile(gguf_name: str, parts: ChatParts, lead_in_template: bool) -> str:
    """The Modelfile text: FROM the GGUF beside it, its TEMPLATE and stop parameters.

    ``lead_in_template``: the template writes the BOS text itself (llama.cpp adds none for this
    GGUF); otherwise the runtime adds it.
    """
    roles = ""
    for i, role in enumerate(r for r in ("system", "user", "assistant") if r in parts.before):
        word = "if" if i == 0 else "else if"
        roles += (f'{{{{ {word} eq .Role "{role}" }}}}{_go(parts.before[role])}{{{{ .Content }}}}'
                  f"{_go(parts.after[role])}")
    template = ((_go(parts.lead) if lead_in_template else "")
                + "{{- range $i, $_ := .Messages }}"
                + "{{- $last := eq (len (slice $.Messages $i)) 1 }}"
                + roles + "{{ end }}"
                + f'{{{{- if and $last (ne .Role "assistant") }}}}{_go(parts.generation)}{{{{ end }}}}'
                + "{{- end }}")
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{s}"' for s in parts.stops if '"' not in s]
    lines += ["PARAMETER temperature 0", ""]
    return "\n".join(lines)
