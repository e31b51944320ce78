"""ChatWidget: talk to a deployed endpoint from a notebook, with tokens shown as they stream in.

By default each question is asked on its own (most fine-tuning data is one question, one answer,
and a model tuned on it answers an earlier turn's question otherwise). With "remember earlier
turns" ticked (``multi_turn=True``) the conversation, kept in ``messages`` (OpenAI format), is
sent whole on each turn, as the multi-turn chat template saw it in training. Temperature, max
tokens and the served model (base or one of the adapters) are widgets; ``send(text)`` does from
code what the button does. An endpoint that stopped says so, and how to get one back.

    >>> ChatWidget(endpoint)                                   # doctest: +SKIP
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W

_BUBBLE = ("<div style='margin:4px 0;padding:6px 10px;border-radius:8px;max-width:540px;"
           "background:{bg};white-space:pre-wrap'><b>{who}</b> {text}</div>")
_COLOURS = {"user": "#e8f0fe", "assistant": "#f1f3f4"}


class ChatWidget(W.VBox):
    def __init__(self, endpoint: Any, model: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 64, multi_turn: bool = False) -> None:
        self.endpoint = endpoint
        self.messages: list[dict[str, str]] = []
        self.model = W.Dropdown(options=endpoint.models, value=model or endpoint.model,
                                description="model")
        self.temperature = W.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.05,
                                         description="temperature", readout_format=".2f")
        self.max_tokens = W.IntSlider(value=max_tokens, min=1, max=1024, description="max tokens")
        self.multi_turn = W.Checkbox(multi_turn, description="remember earlier turns",
                                     indent=False)
        self.conversation = W.HTML(layout=W.Layout(min_height="60px"))
        self.prompt = W.Text(placeholder="Ask something and press Enter",
                             layout=W.Layout(width="420px"))
        self.send_button = W.Button(description="Send", icon="paper-plane", button_style="primary")
        self.clear_button = W.Button(description="Clear", icon="trash")
        self.status = W.HTML()
        self.send_button.on_click(lambda _b: self._send_from_box())
        self.prompt.continuous_update = False
        self.prompt.observe(lambda ch: self._send_from_box() if ch["new"] else None, "value")
        self.clear_button.on_click(lambda _b: self.clear())
        super().__init__([
            W.HTML(f"<b>{html.escape(endpoint.name)}</b> &nbsp; {html.escape(endpoint.api_base)}"),
            W.HBox([self.model, self.temperature, self.max_tokens, self.multi_turn]),
            self.conversation,
            W.HBox([self.prompt, self.send_button, self.clear_button]),
            self.status,
        ])

    def _render(self, partial: str | None = None) -> None:
        turns = list(self.messages)
        if partial is not None:
            turns.append({"role": "assistant", "content": partial + "▌"})
        self.conversation.value = "".join(
            _BUBBLE.format(bg=_COLOURS.get(m["role"], "#fff"), who=html.escape(m["role"]),
                           text=html.escape(m["content"]))
            for m in turns)

    def _send_from_box(self) -> None:
        text = self.prompt.value.strip()
        if text:
            self.prompt.value = ""
            self.send(text)

    def send(self, text: str) -> str:
        """Add a user turn, stream the reply into the conversation, and return it."""
        if not self.multi_turn.value:
            self.messages.clear()  # one question at a time: nothing earlier is sent
        self.messages.append({"role": "user", "content": text})
        self.send_button.disabled = True
        reply = ""
        self.status.value = ""
        try:
            self._render("")
            for piece in self.endpoint.chat(self.messages, model=self.model.value,
                                            temperature=self.temperature.value,
                                            max_tokens=self.max_tokens.value, stream=True):
                reply += piece
                self._render(reply)
        except Exception as exc:  # shown in the widget: a button callback has nowhere to raise to
            self.messages.pop()
            self.status.value = f"<span style='color:#d62728'>{html.escape(self._why(exc))}</span>"
            self._render()
            return ""
        finally:
            self.send_button.disabled = False
        self.messages.append({"role": "assistant", "content": reply})
        self._render()
        return reply

    def _why(self, exc: Exception) -> str:
        """What went wrong, in the endpoint's terms: a stopped endpoint says it stopped."""
        try:
            state = self.endpoint.state  # the registry's word, refreshed from its processes
        except Exception:  # noqa: BLE001 - the registry cannot say: the error itself is shown
            return str(exc)
        if state not in ("stopped", "failed"):  # the ended states an endpoint is recorded in
            return f"{exc} (endpoint {self.endpoint.name} is {state}: ep.logs() shows its log)"
        return (f"endpoint {self.endpoint.name} is {state}, so nothing answers; deploy the run "
                "again (workbench.deploy) and chat with the new endpoint")

    def clear(self) -> None:
        self.messages.clear()
        self.status.value = ""
        self._render()
