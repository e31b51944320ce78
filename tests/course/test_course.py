"""A real class: JupyterHub + configurable-http-proxy on loopback, the course service declared in
the hub config by ``workbench course init``, and real local Unix users (made with useradd, removed
after): two students and an instructor, each calling the service with their own hub token.

One hub serves the whole module; the tests run in file order and build on each other (A's run,
B's refusal, isolation, the grant, then B's run across a kill of the service). The runs are real
training of the built-in tiny model on CPU, priced by the course's CPU price.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.waiting import wait_for
from workbench.course.client import CourseClient
from workbench.course.ledger import Ledger
from workbench.errors import CourseError, InsufficientCreditError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# A short run: one CPU process, a few steps. The course prices a CPU core-hour at 36 CNY, so its
# ~30-60 s cost tens of fen: measurable in a ledger kept in fen.
SMALL_RUN = {"name": "small", "train": {"max_steps": 6, "eval_every": 0},
             "resources": {"processes_per_node": 1},
             "data": {"sources": [{"max_rows": 48}], "eval_samples": 8}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read().decode()
            code = resp.status
    except urllib.error.HTTPError as exc:
        text, code = exc.read().decode(), exc.code
    except (urllib.error.URLError, ConnectionError) as exc:
        return 0, str(exc)
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


def _wait_for(what: str, check: Any, timeout: float, log: Path | None = None) -> Any:
    """The suite's poll loop (tests/waiting.py), with the hub's or service's log tail on failure."""
    try:
        return wait_for(check, timeout, what, every=0.5)
    except AssertionError as exc:
        tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
        raise AssertionError(f"{exc}\n{tail}") from None


def _students_python(root: Path) -> Path:
    """A venv the students' Unix users can run (jupyterhub-singleuser, workbench_lab): the
    interpreter copied out of its 0700 home under /root into ``root``, the project's venv added
    as a site dir, this checkout first on PYTHONPATH (set in the spawner's environment)."""
    base, ver = Path(sys.base_prefix), f"python{sys.version_info[0]}.{sys.version_info[1]}"
    py = root / "python"
    (py / "bin").mkdir(parents=True)
    (py / "lib").mkdir()
    shutil.copy2(base / "bin" / ver, py / "bin" / ver)
    for lib in (base / "lib").glob("libpython*"):  # its RUNPATH points under /root
        shutil.copy2(lib, py / "lib" / lib.name, follow_symlinks=False)
    shutil.copytree(base / "lib" / ver, py / "lib" / ver,
                    ignore=shutil.ignore_patterns("site-packages", "test", "idlelib", "tkinter"))
    env = {**os.environ, "LD_LIBRARY_PATH": str(py / "lib")}
    subprocess.run([str(py / "bin" / ver), "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, env=env)
    site = root / "venv" / "lib" / ver / "site-packages"
    project_site = next(Path(p) for p in sys.path if p.endswith("site-packages"))
    (site / "workbench_project.pth").write_text(
        f"import site; site.addsitedir({str(project_site)!r})\n")
    conf = root / "venv" / "etc" / "jupyter" / "jupyter_server_config.d"
    conf.mkdir(parents=True)
    (conf / "workbench_lab.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"workbench_lab": True}}}))
    return root / "venv" / "bin" / "python"


def _service_pids(course_json: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "workbench.course.service" in cmd and str(course_json) in cmd:
            out.append(p.pid)
    return out


@pytest.fixture(scope="module")
def hub() -> Iterator[dict[str, Any]]:
    assert os.geteuid() == 0, "the course tests create Unix users: run them as root (CI does)"
    tag = secrets.token_hex(3)
    users = {"a": f"wbc{tag}a", "b": f"wbc{tag}b", "teacher": f"wbc{tag}t"}
    for name in users.values():
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
    # A world-readable parent, so what keeps students out is the state folder's own mode.
    root = Path(tempfile.mkdtemp(prefix="wbcourse-"))
    root.chmod(0o755)
    state = root / "state"
    port = _free_port()
    course = {
        "name": "test-class", "instructors": [users["teacher"]],
        "students": [users["a"], users["b"]], "currency": "CNY", "default_credit": 20,
        # 36 CNY a core-hour is 1 fen a second; an endpoint's first hour (1000 CNY) fits nobody.
        "credits": {users["b"]: 0.01}, "prices": {"cpu_core_hour": 36, "endpoint_hour": 1000},
        "hold_margin": 10,  # the shared 2-core machine runs far slower than planned
        "caps": {"concurrent_runs": 1, "processes_per_run": 1, "hours_per_run": 1,
                 "eval_minutes": 5},  # held 3 CNY; a loaded machine took 140 s
        "idle_minutes": 1,  # the culler stops A's server, idle after its one request
        "state_dir": str(state),
        "hub": {"port": port, "hub_port": _free_port(), "proxy_api_port": _free_port(),
                "service_port": _free_port()},
    }
    course_file = root / "course.yaml"
    course_file.write_text(yaml.safe_dump(course))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "workbench.cli", "course", "init", str(course_file)],
                   check=True, env=env)
    # A test-only service whose token may issue tokens for the users (what a login would do)
    # and start their servers; the servers run a Python the students' users can execute.
    admin_token = secrets.token_hex(16)
    python = _students_python(root)
    spawner_env = {"PYTHONPATH": f"{REPO}:{REPO / 'extensions' / 'workbench_lab'}",
                   "LD_LIBRARY_PATH": str(root / "python" / "lib")}
    with open(state / "jupyterhub_config.py", "a") as fh:
        fh.write(f"c.JupyterHub.services.append({{'name': 'course-test', "
                 f"'api_token': {admin_token!r}}})\n"
                 "c.JupyterHub.load_roles.append({'name': 'course-test', 'scopes': "
                 "['admin:users', 'admin:servers', 'tokens', 'list:services', 'read:services'], "
                 "'services': ['course-test']})\n"
                 f"c.Spawner.cmd = [{str(python)!r}, '-m', 'jupyterhub.singleuser']\n"
                 f"c.Spawner.environment.update({spawner_env!r})\n"
                 "c.Spawner.start_timeout = c.Spawner.http_timeout = 180\n")
    log = root / "hub.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f",
                                 str(state / "jupyterhub_config.py")], cwd=state, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    info: dict[str, Any] = {"users": users, "state": state, "root": root, "log": log,
                            "admin": admin_token, "base": base,
                            "service": f"{base}/services/course/",
                            "course_json": state / "course.json", "tokens": {}}
    try:
        _wait_for("the hub API", lambda: _http("GET", f"{base}/hub/api/", admin_token)[0] == 200,
                  120, log)
        for key, name in users.items():
            code, answer = _http("POST", f"{base}/hub/api/users/{name}/tokens", admin_token,
                                 {"scopes": ["access:services!service=course",
                                             f"access:servers!user={name}"], "note": "test"})
            assert code == 201, answer
            info["tokens"][key] = answer["token"]
        info["client"] = {k: CourseClient(info["service"], t) for k, t in info["tokens"].items()}
        _wait_for("the course service",
                  lambda: _http("GET", info["service"] + "me", info["tokens"]["a"])[0] == 200,
                  120, log)
        yield info
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _service_pids(state / "course.json"):  # one the hub restarted late
            os.kill(pid, signal.SIGKILL)
        for name in users.values():
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _runs_on_disk(hub: dict[str, Any]) -> list[str]:
    runs = hub["state"] / "home" / "runs"
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


def _settled(client: CourseClient, run_id: str) -> dict[str, Any] | None:
    try:
        view = client.run(run_id)
    except CourseError:  # the service is restarting (the proxy answers 503 meanwhile)
        return None
    return view if view.get("charge") is not None else None


def test_a_student_launches_through_workbench_launch_within_credit(
        hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Student A's kernel environment (only A's hub token and the course URL, as the hub config
    gives a course's servers): workbench.launch() goes to the service, which holds, runs and
    charges it. (The kernel runs in this process: here the venv's interpreter lives under /root,
    which A's Unix user cannot execute; the on-disk isolation is checked as B's user below.)"""
    import workbench

    a = hub["client"]["a"]
    assert a.me()["balance"] == 2000  # 20 CNY starting credit, in fen
    monkeypatch.setenv("WORKBENCH_COURSE_URL", hub["service"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["a"])
    job = workbench.launch(SMALL_RUN)
    assert type(job).__name__ == "CourseJob"
    run_id = job.id
    hub["a_run"], hub["a_job"] = run_id, job
    assert run_id in _runs_on_disk(hub)  # owned by the service, not in A's home
    view = _wait_for("A's run to end and settle", lambda: _settled(a, run_id), 300, hub["log"])
    # Under heavy load a run may still outlast its hold: its budget stop then ends it, and the
    # charge stays within the hold either way.
    assert view["state"] in ("succeeded", "budget_stopped"), view
    status = json.loads((hub["state"] / "home" / "runs" / run_id / "status.json").read_text())
    assert 0 < view["charge"] <= view["hold"] <= 2000
    assert status["cost"] * 100 <= view["charge"] < status["cost"] * 100 + 1  # whole fen, up
    me = a.me()
    assert me["held"] == 0 and me["balance"] == 2000 - view["charge"]


def test_a_students_evaluate_resume_deploy_and_sweep_go_through_the_service(
        hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """In A's kernel environment: job.evaluate() is held and charged by the second it ran,
    job.resume() is held and charged only what it added, workbench.deploy() is refused before
    anything starts (an endpoint's first hour costs more than any credit), a sweep is refused."""
    import workbench

    a, job, run_id = hub["client"]["a"], hub["a_job"], hub["a_run"]
    monkeypatch.setenv("WORKBENCH_COURSE_URL", hub["service"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["a"])
    run_dir = hub["state"] / "home" / "runs" / run_id
    balance = a.me()["balance"]
    started = time.time()
    report = job.evaluate("heldout", max_samples=4)
    took = time.time() - started
    assert "heldout" in report["table"]
    # 36 CNY a core-hour is 1 fen a second: the charge is at most the seconds the call took.
    assert 0 < report["charge"] <= min(report["hold"], took + 1)
    manual = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()
              if json.loads(line).get("phase") == "manual"]
    assert manual and manual[-1]["task"] == "heldout"
    me = a.me()
    assert me["held"] == 0 and me["balance"] == balance - report["charge"]

    before = json.loads((run_dir / "status.json").read_text())
    job.resume(**{"train.max_steps": 9})
    assert a.run(run_id)["kind"] == "resume" and a.me()["held"] > 0
    view = _wait_for("A's resumed run to settle", lambda: _settled(a, run_id), 300, hub["log"])
    after = json.loads((run_dir / "status.json").read_text())
    assert view["state"] in ("succeeded", "budget_stopped"), view
    if view["state"] == "succeeded":
        assert after["step"] == 9
    added = (after["cost"] - before["cost"]) * 100  # the resume's bill, not the whole run's
    assert added <= view["charge"] < added + 1 and view["charge"] <= view["hold"]
    assert a.me()["balance"] == me["balance"] - view["charge"]

    with pytest.raises(InsufficientCreditError, match="1000.00 CNY.*nothing was started"):
        workbench.deploy(job)
    assert not (hub["state"] / "home" / "endpoints").exists() or not any(
        (hub["state"] / "home" / "endpoints").iterdir())
    assert a.endpoints() == []
    with pytest.raises(CourseError, match="sweeps are not available in a course"):
        workbench.sweep(SMALL_RUN, space={"train.lr": [1e-3, 2e-3]})
    assert a.me()["balance"] == me["balance"] - view["charge"]  # neither held nor charged


def test_a_run_over_credit_is_refused_before_it_starts(hub: dict[str, Any]) -> None:
    b = hub["client"]["b"]
    before = _runs_on_disk(hub)
    with pytest.raises(InsufficientCreditError) as err:
        b.launch(SMALL_RUN)
    message = str(err.value)
    assert "0.01 CNY" in message and "nothing was started" in message and "instructor" in message
    assert _runs_on_disk(hub) == before
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    assert [e["kind"] for e in ledger.entries(hub["users"]["b"])] == ["credit"]


def test_a_student_cannot_see_others_runs_or_raise_their_credit(hub: dict[str, Any]) -> None:
    b, token_b, service = hub["client"]["b"], hub["tokens"]["b"], hub["service"]
    assert hub["a_run"] not in [r["run"] for r in b.runs()]
    assert _http("GET", f"{service}runs/{hub['a_run']}", token_b)[0] == 403
    assert _http("POST", f"{service}stop/{hub['a_run']}", token_b)[0] == 403
    assert _http("POST", f"{service}grant", token_b,
                 {"student": hub["users"]["b"], "amount": 100})[0] == 403
    assert _http("GET", f"{service}export.csv", token_b)[0] == 403
    assert _http("GET", f"{service}me", "not-a-token")[0] == 403
    for action, body in ((f"evaluate/{hub['a_run']}", {}), (f"resume/{hub['a_run']}", {}),
                         ("deploy", {"runs": [hub["a_run"]]}), ("students", None)):
        code, answer = _http("POST" if body is not None else "GET", service + action, token_b,
                             body)
        assert code == 403, (action, answer)
    assert b.me()["balance"] == 1
    # On disk: B's own Unix user can list the parent but not the ledger, prices or A's run.
    user_b = hub["users"]["b"]
    ls = subprocess.run(["runuser", "-u", user_b, "--", "ls", str(hub["root"])],
                        capture_output=True, text=True)
    assert ls.returncode == 0 and "state" in ls.stdout
    for path in (hub["state"] / "ledger.sqlite", hub["state"] / "course.json",
                 hub["state"] / "home" / "runs" / hub["a_run"] / "status.json"):
        read = subprocess.run(["runuser", "-u", user_b, "--", "cat", str(path)],
                              capture_output=True, text=True)
        assert read.returncode != 0 and "Permission denied" in read.stderr, path


def test_the_panel_shows_a_students_credit_from_their_own_server(hub: dict[str, Any]) -> None:
    """A's single-user server, spawned by the hub as A's Unix user from a Python A can run:
    the lab extension's /workbench/api/course answers A's balance, held and spent (in CNY)
    from the course service, with the server's own hub token."""
    base, name, admin = hub["base"], hub["users"]["a"], hub["admin"]
    code, answer = _http("POST", f"{base}/hub/api/users/{name}/server", admin)
    assert code in (201, 202), answer

    def ready() -> bool:
        user = _http("GET", f"{base}/hub/api/users/{name}", admin)[1]
        return bool(user["servers"].get("", {}).get("ready"))

    _wait_for("A's server", ready, 180, hub["log"])
    me = hub["client"]["a"].me()
    code, panel = _http("GET", f"{base}/user/{name}/workbench/api/course", hub["tokens"]["a"])
    assert code == 200, panel
    assert panel["course"] is True and panel["instructor"] is False and panel["currency"] == "CNY"
    assert panel["me"]["balance"] == pytest.approx(me["balance"] / 100)
    assert panel["me"]["spent"] == pytest.approx(me["charges"] / 100) and panel["me"]["spent"] > 0
    assert panel["me"]["held"] == 0 and "students" not in panel
    owners = {p.username() for p in psutil.process_iter()
              if "jupyterhub.singleuser" in " ".join(_cmdline(p))}
    assert owners == {name}  # the server runs as A, not as root


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_instructor_grant_lets_the_launch_run_across_a_service_kill(hub: dict[str, Any]) -> None:
    from workbench_lab.course import course_grant, course_panel

    teacher, b = hub["client"]["teacher"], hub["client"]["b"]
    user_b = hub["users"]["b"]
    # The planner learns from ended runs (A's), so ask the course what B's run will hold.
    need = b.quote(SMALL_RUN)["hold"]
    assert need > b.me()["balance"] == 1
    grant = (need // 100) + 1  # whole CNY, enough for the hold
    # The instructor's panel: every student's account, and its grant form.
    table = {row["student"]: row for row in course_panel(teacher)["students"]}
    assert table[user_b]["balance"] == 0.01 and table[hub["users"]["a"]]["runs"] == 1
    panel = course_grant({"student": user_b, "amount": grant, "note": "lab 2"}, teacher)
    assert {row["student"]: row for row in panel["students"]}[user_b]["balance"] == \
        pytest.approx(0.01 + grant)
    assert b.me()["balance"] == 1 + grant * 100
    job = b.launch(SMALL_RUN)
    assert job.id in [r["run"] for r in teacher.runs()]  # the instructor sees every run
    _wait_for("B's run to start", lambda: job.state in ("running", "succeeded"), 240, hub["log"])
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    rows_before = ledger.entries()
    assert job.id in [h.run_id for h in ledger.holds(open_only=True)]  # killed before settling
    [old_pid] = _service_pids(hub["course_json"])
    os.kill(old_pid, signal.SIGKILL)
    # The run is detached from the service; the hub starts the service again (it polls it).
    _wait_for("the hub to restart the service",
              lambda: [p for p in _service_pids(hub["course_json"]) if p != old_pid], 120,
              hub["log"])
    _wait_for("the restarted service to answer",
              lambda: _http("GET", hub["service"] + "me", hub["tokens"]["b"])[0] == 200, 120,
              hub["log"])
    view = _wait_for("B's run to settle after the restart", lambda: _settled(b, job.id), 300,
                     hub["log"])
    rows_after = ledger.entries()
    assert rows_after[:len(rows_before)] == rows_before
    assert view["state"] in ("succeeded", "budget_stopped") and 0 < view["charge"] <= view["hold"]
    assert b.me()["balance"] == 1 + grant * 100 - view["charge"]
    csv = teacher.export_csv().splitlines()
    spend = {line.split(",")[0]: line.split(",") for line in csv[1:]}
    assert float(spend[user_b][3]) * 100 == pytest.approx(view["charge"])
    assert float(spend[user_b][2]) == grant


def test_a_student_is_refused_force_and_a_course_error_is_typed(hub: dict[str, Any]) -> None:
    from workbench.course.client import launch_via_course

    with pytest.raises(CourseError, match="force=True"):
        launch_via_course(SMALL_RUN, force=True)
    with pytest.raises(CourseError, match="allows 1 per run|processes"):
        hub["client"]["a"].launch({**SMALL_RUN, "resources": {"processes_per_node": 2}})


def test_the_idle_culler_stopped_the_students_server(hub: dict[str, Any]) -> None:
    """jupyterhub-idle-culler, configured by `workbench course init` (idle_minutes: 1), stops
    A's server, idle since the panel test."""
    base, name, admin = hub["base"], hub["users"]["a"], hub["admin"]
    services = _http("GET", f"{base}/hub/api/services", admin)[1]
    assert "idle-culler" in services
    _wait_for("the culler to stop A's idle server",
              lambda: _http("GET", f"{base}/hub/api/users/{name}", admin)[1]["servers"] == {},
              240, hub["log"])
    assert "Culling server" in hub["log"].read_text(errors="replace")
