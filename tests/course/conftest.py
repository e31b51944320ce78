"""The course tests' one real class, shared by the session: JupyterHub + configurable-http-proxy on
loopback, the course service declared in the hub config by ``workbench course init``, and real
local Unix users (made with useradd, given passwords for the hub's PAM login page, removed after):
two students and an instructor, each with their own hub token.
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
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.waiting import wait_for
from workbench.course.client import CourseClient
from workbench.course.config import Course

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
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


def wait_until(what: str, check: Any, timeout: float, log: Path | None = None) -> Any:
    """The suite's poll loop (tests/waiting.py), with the hub's or service's log tail on failure."""
    try:
        return wait_for(check, timeout, what, every=0.5)
    except AssertionError as exc:
        tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
        raise AssertionError(f"{exc}\n{tail}") from None


def _up_or_ended(proc: subprocess.Popen, base: str, token: str) -> bool:
    """Does the hub's API answer? An AssertionError (with its exit status) once it has exited."""
    if proc.poll() is not None:
        raise AssertionError(f"the hub exited with status {proc.returncode}")
    return http("GET", f"{base}/hub/api/", token)[0] == 200


def _students_python(root: Path) -> Path:
    """A venv the students' Unix users can run (jupyterhub-singleuser, workbench_lab): the
    interpreter copied out of its 0700 home under /root into ``root``, the project's venv added
    as a site dir (its editable install of workbench imports this checkout's package; the
    checkout's root stays off their sys.path), and beside it ``serve-venv``, which adds the
    checkout's serving venv (vLLM) the same way. The students reach them wherever the clone
    lives through the students_reach fixture."""
    from tests.course.reach import project_site, serving_site

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
    (site / "workbench_project.pth").write_text(
        f"import site; site.addsitedir({str(project_site())!r})\n")
    # The serving venv's packages (vLLM) the same way, for the endpoints students run as
    # themselves on the hub machine.
    serve = root / "serve-venv"
    subprocess.run([str(py / "bin" / ver), "-m", "venv", "--without-pip", str(serve)],
                   check=True, env=env)
    if serving_site() is not None:
        (serve / "lib" / ver / "site-packages" / "workbench_serve.pth").write_text(
            f"import site; site.addsitedir({str(serving_site())!r})\n")
    conf = root / "venv" / "etc" / "jupyter" / "jupyter_server_config.d"
    conf.mkdir(parents=True)
    (conf / "workbench_lab.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": {"workbench_lab": True, "jupyterlab": True}}}))
    return root / "venv" / "bin" / "python"


def _kill_left_of(hub_pid: int, base: str) -> None:
    """Kill what a hub at ``base`` started and left (a hub killed before its shutdown ended):
    its process group, its proxy (on the hub's port), and processes given its API (its
    services: the culler, the course service; the students' servers)."""
    try:
        os.killpg(hub_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    port = base.rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            proxy = any("configurable-http-proxy" in c for c in cmd) and any(
                a == "--port" and b == port for a, b in zip(cmd, cmd[1:]))
            if proxy or p.environ().get("JUPYTERHUB_API_URL", "").startswith(f"{base}/"):
                p.kill()
        except (psutil.Error, OSError):
            continue


def service_pids(course_json: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "workbench.course.service" in cmd and str(course_json) in cmd:
            out.append(p.pid)
    return out


@contextmanager
def running_hub(people: dict[str, str], course_of: Callable[[dict[str, str]], dict[str, Any]],
                prefix: str = "wbc") -> Iterator[dict[str, Any]]:
    """A real class on the hub: ``people`` maps each key to the end of its Unix user's name
    (``{prefix}{tag}{end}``, a random tag); ``course_of(users)`` gives the course file's people,
    money and limits, to which the state folder, ports and the students' interpreter are added.
    Each person gets a password (the hub's PAM login page) and a hub token; all go at the end."""
    assert os.geteuid() == 0, "the course tests create Unix users: run them as root (CI does)"
    tag = secrets.token_hex(3)
    users = {key: f"{prefix}{tag}{end}" for key, end in people.items()}
    passwords = {key: secrets.token_urlsafe(12) for key in users}
    for key, name in users.items():
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
        # The hub's PAM login page checks these (the browser test logs in with them).
        subprocess.run(["chpasswd"], input=f"{name}:{passwords[key]}\n", text=True, check=True)
    # A world-readable parent, so what keeps students out is the state folder's own mode.
    root = Path(tempfile.mkdtemp(prefix="wbcourse-"))
    root.chmod(0o755)
    state = root / "state"
    port = free_port()
    course = {**course_of(users), "state_dir": str(state),
              "hub": {"port": port, "hub_port": free_port(), "proxy_api_port": free_port(),
                      "service_port": free_port()}}
    # The students' servers and their work (run as them by the service, through sudo) use a
    # Python their users can execute; `init` passes its library path to the service.
    python = _students_python(root)
    course["student_python"] = str(python)
    course["serve_python"] = str(root / "serve-venv" / "bin" / "python")
    course_file = root / "course.yaml"
    course_file.write_text(yaml.safe_dump(course))
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "python" / "lib")}
    subprocess.run([sys.executable, "-m", "workbench.cli", "course", "init", str(course_file)],
                   check=True, env=env)
    # A test-only service whose token may issue tokens for the users (what a login would do)
    # and start their servers.
    admin_token = secrets.token_hex(16)
    # The project venv's JupyterLab assets and labextensions (the built Workbench panel) and
    # kernelspecs (their "python" runs the students' interpreter); the server reports its
    # activity every 10 s, so the culler (idle_minutes: 1) leaves a server in use alone.
    jupyter = Path(sys.prefix) / "share" / "jupyter"
    spawner_env = {"LD_LIBRARY_PATH": str(root / "python" / "lib"),
                   "JUPYTER_PATH": str(jupyter), "JUPYTERLAB_DIR": str(jupyter / "lab"),
                   "JUPYTERHUB_ACTIVITY_INTERVAL": "10"}
    with open(state / "jupyterhub_config.py", "a") as fh:
        fh.write(f"c.JupyterHub.services.append({{'name': 'course-test', "
                 f"'api_token': {admin_token!r}}})\n"
                 "c.JupyterHub.load_roles.append({'name': 'course-test', 'scopes': "
                 "['admin:users', 'admin:servers', 'tokens', 'list:services', 'read:services'], "
                 "'services': ['course-test']})\n"
                 f"c.Spawner.cmd = [{str(python)!r}, '-m', 'jupyterhub.singleuser']\n"
                 # window.jupyterapp: the browser test runs a cell as tests/lab's do.
                 "c.Spawner.args = ['--LabApp.expose_app_in_browser=True']\n"
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
                            "passwords": passwords, "course": course,
                            "service": f"{base}/services/course/",
                            "course_json": state / "course.json", "tokens": {}}
    try:
        # Up when its API answers, failed when its process ended; the limit is only a bound for
        # a hub that hangs, generous because a loaded 2-core machine starts one slowly.
        wait_until("the hub API", lambda: _up_or_ended(proc, base, admin_token), 600, log)
        for key, name in users.items():
            code, answer = http("POST", f"{base}/hub/api/users/{name}/tokens", admin_token,
                                 {"scopes": ["access:services!service=course",
                                             f"access:servers!user={name}"], "note": "test"})
            assert code == 201, answer
            info["tokens"][key] = answer["token"]
        info["client"] = {k: CourseClient(info["service"], t) for k, t in info["tokens"].items()}
        first = next(k for k, n in users.items() if n in course["students"])
        wait_until("the course service",
                  lambda: http("GET", info["service"] + "me", info["tokens"][first])[0] == 200,
                  300, log)
        yield info
    finally:
        # The hub alone: its own shutdown stops its services (each in a session of its own,
        # out of reach of its process group), the proxy and the students' servers.
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        _kill_left_of(proc.pid, base)
        for name in users.values():
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def hub(students_reach: list) -> Iterator[dict[str, Any]]:  # students_reach: tests/course/reach.py
    def course(users: dict[str, str]) -> dict[str, Any]:
        return {
            "name": "test-class", "instructors": [users["teacher"]],
            "students": [users["a"], users["b"], users["c"]], "currency": "CNY",
            "default_credit": 20,
            # 36 CNY a core-hour is 1 fen a second; an endpoint's first hour (1000 CNY) fits
            # nobody. B keeps its 1 fen (the refusals); C is the one the instructor's grant
            # lifts, so no test finds B's balance changed by another.
            "credits": {users["b"]: 0.01, users["c"]: 0.01},
            "prices": {"cpu_core_hour": 36, "endpoint_hour": 1000},
            "hold_margin": 10,  # the shared 2-core machine runs far slower than planned
            # Two at once: A's sweep runs its two trials side by side (half the wall time).
            "caps": {"concurrent_runs": 2, "processes_per_run": 1, "hours_per_run": 1,
                     "eval_minutes": 5},  # held 3 CNY; a loaded machine took 140 s
            "idle_minutes": 1,  # the culler stops the browser test's servers once its pages close
        }

    with running_hub({"a": "a", "b": "b", "c": "c", "teacher": "t"}, course) as info:
        yield info


@pytest.fixture(scope="session")
def classroom(students_reach: list) -> Iterator[dict[str, Any]]:
    """A class without a hub, for what runs as whom (test_isolation.py, test_course_eval.py):
    two students (``ana``, ``ben``: real users with random names) and a function that makes a
    :class:`Course` for them with the students' interpreter; the users and folders go at the end."""
    assert os.geteuid() == 0, "the course tests create Unix users: run them as root (CI does)"
    tag = secrets.token_hex(3)
    users = {"ana": f"wbi{tag}a", "ben": f"wbi{tag}b"}
    for name in users.values():
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
    root = Path(tempfile.mkdtemp(prefix="wbclass-"))
    root.chmod(0o755)
    python = _students_python(root)
    old = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = str(root / "python" / "lib")  # what the hub config passes

    def course(**over: Any) -> Course:
        state = root / f"state-{secrets.token_hex(3)}"
        state.mkdir(mode=0o711)
        return Course.model_validate({
            "name": "iso", "instructors": ["teacher"], "students": list(users.values()),
            "default_credit": 10, "state_dir": str(state), "student_python": str(python),
            "prices": {"cpu_core_hour": 36}, **over})

    try:
        yield {"users": users, "root": root, "python": python, "course": course}
    finally:
        if old is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = old
        for name in users.values():
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
