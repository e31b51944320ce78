"""An endpoint handle acts only on the deployment it was made for, and an endpoint is recorded
ended only once its processes are gone (issue 42, item 3).

Everything is real (``workbench.deploy``, the guard process, the registry, ``workbench undeploy``)
except the server: the serving Python is this interpreter with a stand-in ``vllm`` package on its
path (STAND_IN, a small HTTP server answering /health and /v1/models on the port deploy gives
it). Real vLLM takes 50-100 s to start on 2 cores, and what is under test reads nothing from the
server beyond /health.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.waiting import alive, wait_for
from workbench.cli import run
from workbench.runs.registry import Registry
from workbench.serve import EndpointReplacedError, deploy, endpoints, get_endpoint

STAND_IN = '''"""Stand-in for vLLM's OpenAI server (tests only): /health and /v1/models on --host/--port."""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
args, _ = parser.parse_known_args()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        answers = {"/health": {}, "/v1/models": {"data": [{"id": args.served_model_name}]}}
        body = json.dumps(answers.get(self.path, {"error": "not found"})).encode()
        self.send_response(200 if self.path in answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
'''


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A serving Python whose ``vllm.entrypoints.openai.api_server`` is STAND_IN."""
    root = tmp_path_factory.mktemp("stand-in-vllm")
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(STAND_IN)
    python = root / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={root} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def _deploy(model: Path, name: str, python: str):  # noqa: ANN202 - an Endpoint
    return deploy(model, name=name, python=python, progress=False, timeout=120)


def test_a_stale_handle_cannot_stop_the_endpoint_that_now_has_its_name(stand_in, tiny_model):
    first = _deploy(tiny_model, "twin", stand_in)
    first_pids = (first.record.pid, first.record.server_pid)
    assert all(alive(p) for p in first_pids)
    assert run(["undeploy", "twin"]) == "stopped"  # what `workbench undeploy twin` runs
    assert not any(alive(p) for p in first_pids)
    second = _deploy(tiny_model, "twin", stand_in)
    second_pids = (second.record.pid, second.record.server_pid)
    try:
        with pytest.raises(EndpointReplacedError,
                           match=r"newer deployment.*workbench\.serve\.get_endpoint\('twin'\)"):
            first.stop()
        # It changed nothing: the newer endpoint still runs, answers and is recorded healthy.
        assert all(alive(p) for p in second_pids) and second.healthy()
        assert get_endpoint("twin").state == "healthy"
        # Nor does the stale handle reach the newer server, or report its state as its own.
        with pytest.raises(EndpointReplacedError):
            first.chat("hello?")
        with pytest.raises(EndpointReplacedError):
            first.state  # noqa: B018 - the property is what is under test
        assert "replaced by a newer deployment" in repr(first)
    finally:
        second.stop()
    assert not any(alive(p) for p in second_pids)
    assert get_endpoint("twin").state == "stopped"


def test_an_endpoint_whose_guard_was_killed_is_live_until_its_server_is_stopped(stand_in,
                                                                                 tiny_model):
    ep = _deploy(tiny_model, "orphaned", stand_in)
    guard, server = ep.record.pid, ep.record.server_pid
    try:
        os.kill(guard, signal.SIGKILL)  # the server, in the guard's group, is not signalled
        wait_for(lambda: not alive(guard), 30, "the killed guard to end")
        assert alive(server) and ep.healthy()
        # Still answering, so still live: listed, and stoppable (the lab panel's Stop button).
        assert get_endpoint("orphaned").state == "healthy"
        assert "orphaned" in [e.name for e in endpoints()]
    finally:
        ep.stop()
    assert not alive(server)
    assert get_endpoint("orphaned").state == "stopped"


def test_a_registry_from_before_deployment_ids_opens_and_its_endpoints_still_update(tmp_path):
    """An older registry (no ``deployment`` column) gains it on first open; its rows read None,
    and a write names that None, so it still lands on them (and only on them)."""
    path = tmp_path / "registry.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE endpoints (name TEXT PRIMARY KEY, target TEXT NOT NULL, "
                   "url TEXT NOT NULL, state TEXT NOT NULL, pid INTEGER, server_pid INTEGER, "
                   "endpoint_dir TEXT NOT NULL, serves TEXT NOT NULL, created REAL NOT NULL, "
                   "updated REAL NOT NULL)")
        db.execute("INSERT INTO endpoints VALUES ('old', 'local', 'http://127.0.0.1:9', "
                   "'healthy', 1, 2, '/nowhere', '{}', 1.0, 1.0)")
    db.close()
    registry = Registry(path)
    assert registry.get_endpoint("old").deployment is None
    assert not registry.update_endpoint("old", deployment="a-newer-one", state="stopped")
    assert registry.get_endpoint("old").state == "healthy"
    assert registry.update_endpoint("old", deployment=None, state="stopped")
    assert registry.get_endpoint("old").state == "stopped"
    assert Registry(path).get_endpoint("old").state == "stopped"  # a second open adds nothing
