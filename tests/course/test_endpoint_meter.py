"""The course's endpoint meter on a real ledger (SQLite) and a real registry: blocks held ahead,
charged when passed, the endpoint stopped when the next block cannot be held or when it idles.

The "server" is a real process registered as the endpoint, ``python -m http.server`` serving the
endpoint folder, so its /metrics is a file the test writes in vLLM's Prometheus format. vLLM
itself takes 50-100 s to start on 2 cores; what is under test reads only the registry, the
process and /metrics. The meter's clock is passed in (``tick(now=...)``), so no test waits.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.waiting import wait_for
from workbench.course.config import Course
from workbench.course.desk import CourseDesk
from workbench.course.endpoints import EndpointMeter
from workbench.runs.ledger import Ledger
from workbench.runs.registry import EndpointRecord, Registry
from workbench.serve.endpoint import STOP_FILE, refresh_state


def _metrics(done: int, running: int) -> str:
    # The lines vLLM's /metrics has for these two series (labels included).
    return ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(running)}\n'
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} '
            f"{float(done)}\n"
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} '
            "1.0\n")


@pytest.fixture
def course_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    servers: list[subprocess.Popen] = []

    def serve(name: str) -> Path:
        folder = tmp_path / "home" / "endpoints" / name
        folder.mkdir(parents=True)
        (folder / "metrics").write_text(_metrics(3, 0))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                 "127.0.0.1", "--directory", str(folder)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        servers.append(proc)
        url = f"http://127.0.0.1:{port}"
        def answers() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_for(answers, 60, f"the stand-in server on port {port}")
        now = time.time()
        Registry().add_endpoint(EndpointRecord(
            name=name, target="local", url=url, state="healthy", pid=proc.pid, server_pid=None,
            endpoint_dir=str(folder), serves="{}", created=now, updated=now))
        return folder

    yield {"serve": serve, "root": tmp_path}
    for proc in servers:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _meter(root: Path, credit: float, idle_minutes: float = 30) -> EndpointMeter:
    course = Course.model_validate({
        "name": "meter", "instructors": ["teacher"], "students": ["ana"],
        "default_credit": credit, "state_dir": str(root / "state"),
        "prices": {"endpoint_hour": 36},  # 1 fen a second
        "endpoint_hold_minutes": 1, "idle_minutes": idle_minutes})
    desk = CourseDesk(course, Ledger(f"sqlite:///{root / 'ledger.sqlite'}"))
    desk.open_accounts()
    return EndpointMeter(desk)


def _deployed(meter: EndpointMeter, name: str, folder: Path, since: float) -> int:
    """The rows deploy writes before its server starts: the first block's hold and what for."""
    hold = meter.ledger.hold("ana", 60, actor="ana", note=f"deploy {name}")
    meter.ledger.attach_run(hold, name, str(folder), kind="endpoint", since=since)
    return hold


def test_blocks_are_held_ahead_and_the_endpoint_stops_when_the_credit_runs_out(
        course_home: dict) -> None:
    meter = _meter(course_home["root"], credit=1.5)  # 150 fen: two 60-fen blocks, not three
    folder = course_home["serve"]("ana-ep")
    t0 = time.time()
    first = _deployed(meter, "ana-ep", folder, since=t0)
    ledger = meter.ledger
    assert meter.tick(now=t0 + 10) == [] and ledger.account("ana").held == 60
    meter.tick(now=t0 + 45)  # within 30 s of the block's end: the next block is held
    account = ledger.account("ana")
    assert account.held == 120 and account.balance == 30
    meter.tick(now=t0 + 61)  # the first block has passed: charged in full
    [charge] = [e for e in ledger.entries("ana") if e["kind"] == "charge"]
    assert charge["hold_id"] == first and charge["amount"] == 60
    assert refresh_state("ana-ep").state == "healthy"
    # 30 fen left cannot hold a third block: stopped now, before its paid time ends.
    assert meter.tick(now=t0 + 95) == ["ana-ep"]
    server = Registry().get_endpoint("ana-ep")
    assert refresh_state("ana-ep").state == "stopped"
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == \
        psutil.STATUS_ZOMBIE
    assert "credit ran out" in json.loads((folder / STOP_FILE).read_text())["reason"]
    account = ledger.account("ana")
    # The second block ran from t0 + 60 to the stop at t0 + 95: 35 s, 35 fen; 55 fen stay.
    assert account.held == 0 and account.charges == 60 + 35 and account.balance == 55
    assert ledger.holds(open_only=True) == []


def test_an_idle_endpoint_is_stopped_and_charged_the_seconds_it_was_up(
        course_home: dict) -> None:
    meter = _meter(course_home["root"], credit=5, idle_minutes=0.5)
    folder = course_home["serve"]("ana-idle")
    t0 = time.time()
    _deployed(meter, "ana-idle", folder, since=t0)
    meter.tick(now=t0 + 5)  # first look: 4 requests done (3 stopped, 1 at its length)
    (folder / "metrics").write_text(_metrics(5, 0))  # a request finished
    meter.tick(now=t0 + 20)
    (folder / "metrics").write_text(_metrics(5, 1))  # one running, none finished since
    meter.tick(now=t0 + 40)
    (folder / "metrics").write_text(_metrics(6, 0))
    meter.tick(now=t0 + 60)  # renews its block (credit 500 fen) and saw a request finish
    assert refresh_state("ana-idle").state == "healthy"
    assert meter.tick(now=t0 + 85) == []  # idle 25 s of 30
    # Idle 31 s; the third block (from t0 + 120) was held in the same look and comes back.
    assert meter.tick(now=t0 + 91) == ["ana-idle"]
    assert refresh_state("ana-idle").state == "stopped"
    assert json.loads((folder / STOP_FILE).read_text())["reason"].startswith("idle")
    account = meter.ledger.account("ana")
    assert account.held == 0 and account.charges == 60 + 31 and account.balance == 500 - 91
    assert [e["amount"] for e in meter.ledger.entries("ana") if e["kind"] == "hold"] == [60] * 3


def test_a_student_chats_with_an_endpoint_that_wants_its_key(course_home: dict) -> None:
    """An endpoint off the hub machine (a Slurm node's server) answers only requests with its API
    key: the owner's view carries the key and CourseEndpoint.chat sends it. The chat server here
    is a stand-in that checks the key (vLLM's own check is tested in tests/remote)."""
    import http.server
    import threading

    from workbench.course.client import CourseEndpoint
    from workbench.errors import CourseError

    folder = course_home["serve"]("ana-key")
    (folder / "api_key").write_text("s3cret-key\n")
    meter = _meter(course_home["root"], credit=5)
    _deployed(meter, "ana-key", folder, since=time.time())
    view = meter.view("ana-key")
    assert view["api_key"] == "s3cret-key"

    class Chat(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != "Bearer s3cret-key":
                self.send_response(401)
                self.end_headers()
                return
            answer = {"choices": [{"message": {"content": f"echo {body['messages'][0]['content']}"}}]}
            raw = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ep = CourseEndpoint(None, "ana-key", {**view, "url": url})  # type: ignore[arg-type]
        assert ep.chat("hello") == "echo hello"
        keyless = CourseEndpoint(None, "ana-key", {"url": url, "models": ["m"]})  # type: ignore[arg-type]
        with pytest.raises(CourseError, match="refused the chat .401"):
            keyless.chat("hello")
    finally:
        server.shutdown()
        server.server_close()


def test_every_course_endpoint_gets_a_key_of_its_own(course_home: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A course deploy always starts its server with a key, a new one each time, so a classmate
    on the same hub machine cannot use (or bill, or keep alive) someone's endpoint. The real path
    (vLLM started by the worker as a real student, behind the key) is tested on the hub
    (test_course.py); here the start is replaced by a recorder, and what is under test is what
    the meter asks for."""
    from workbench.course.served import Served

    meter = _meter(course_home["root"], credit=5)
    run_hold = meter.ledger.hold("ana", 10, actor="ana", note="launch r1")
    meter.ledger.attach_run(run_hold, "r1", str(course_home["root"] / "r1"))
    asked: list[dict] = []

    def recorder(student: str, runs: list, name: str, api_key: str, options: dict) -> Served:
        asked.append({"api_key": api_key})
        return Served(name, student, 0, api_key, 0.0, models=["m"])

    monkeypatch.setattr(meter.served, "start", recorder)
    meter.deploy("ana", ["r1"], name="one")
    meter.undeploy("ana", "one.ana")
    meter.deploy("ana", ["r1"], name="two")
    keys = [kw.get("api_key") for kw in asked]
    assert all(isinstance(k, str) and len(k) >= 24 for k in keys), keys
    assert keys[0] != keys[1]
