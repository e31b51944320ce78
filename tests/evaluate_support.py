"""Shared by the evaluation tests: a real OpenAI-compatible HTTP judge and a local lm-eval task.

The judge is a real HTTP server (http.server) that speaks the chat-completions API, written here
independently of workbench: it reads the two answers out of the prompt and prefers the one that
says "good" (asked anything else, it answers "moo" about cows). Its ``mode`` makes it
position-biased (always the first answer), talk nonsense, answer with an HTML page instead of a
chat completion (``html``), refuse the first request it gets with HTTP 400 and hold every
other one until ``release`` is set (``refuse_first``), or hold every chat request until then
(``hold``). Like vLLM before 0.32, it says its models are
``owned_by`` whatever ``owned_by`` holds and has no other POST route than chat completions (404);
``paths`` lists the POSTs it got.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SOUNDS = [("What sound does a cow make?", ["moo", "meow", "croak", "howl"], 0),
          ("Which noise comes from a cat?", ["bleat", "meow", "moo", "croak"], 1),
          ("How does a frog sound?", ["howl", "moo", "croak", "meow"], 2),
          ("What does a wolf say?", ["meow", "croak", "bleat", "howl"], 3),
          ("What sound does a goat make?", ["howl", "bleat", "moo", "meow"], 1)]


class JudgeServer:
    def __init__(self) -> None:
        self.mode = "fair"  # fair | first | nonsense | html | refuse_first | hold
        self.requests: list[str] = []
        self.paths: list[str] = []
        self.owned_by = "test"
        self.release = threading.Event()
        self.refused = False  # refuse_first: whether the first request has been refused
        self.held_answered = 0  # refuse_first: held requests answered (after release or 60 s)
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _send(self, body: dict | str, code: int = 200) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/html" if isinstance(body, str)
                                 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # /v1/models
                self._send({"object": "list", "data": [{"id": "judge-1", "object": "model",
                                                        "created": 0,
                                                        "owned_by": outer.owned_by}]})

            def do_POST(self) -> None:  # /v1/chat/completions
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.paths.append(self.path)
                if self.path != "/v1/chat/completions":
                    self._send({"detail": "Not Found"}, code=404)
                    return
                prompt = body["messages"][-1]["content"]
                with lock:
                    outer.requests.append(prompt)
                    first, outer.refused = not outer.refused, True
                if outer.mode == "html":
                    self._send("<html><body>Welcome to nginx!</body></html>")
                    return
                if outer.mode == "hold":
                    outer.release.wait(60)
                if outer.mode == "refuse_first":
                    if first:
                        self._send({"error": {"message": "bad request"}}, code=400)
                        return
                    outer.release.wait(60)
                    with lock:
                        outer.held_answered += 1
                if "[Answer A]" not in prompt:  # asked as the evaluated model, not as a judge
                    self._reply(body, "moo" if "cow" in prompt else "I do not know")
                    return
                a = re.search(r"\[Answer A\]\n(.*?)\n\n\[Answer B\]", prompt, re.S).group(1)
                b = re.search(r"\[Answer B\]\n(.*?)\n\nCompare", prompt, re.S).group(1)
                if outer.mode == "first":
                    verdict = "[[A]]"
                elif outer.mode == "nonsense":
                    verdict = "Both answers have their charm, hard to say."
                elif ("good" in a) == ("good" in b):
                    verdict = "It is a tie: [[C]]"
                else:
                    verdict = "[[A]]" if "good" in a else "Verdict: [[B]]"
                self._reply(body, verdict)

            def _reply(self, body: dict, content: str) -> None:
                self._send({"id": "c1", "object": "chat.completion", "created": 0,
                            "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": content}}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                      "total_tokens": 2}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_sounds_task(folder: Path, name: str = "wb_sounds") -> Path:
    """A multiple-choice lm-eval task over a jsonl written here, as a user would write one."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in SOUNDS))
    task = folder / f"{name}.yaml"
    task.write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return task
