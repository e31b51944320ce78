"""The course file (course.yaml) and what ``workbench course init`` makes of it.

A course file names the people, the money and the limits of one class::

    name: ml101
    instructors: [teacher]
    students: [ana, ben]              # local (PAM) users; see docs/course.md for OAuth/LTI
    currency: CNY
    default_credit: 10                # each student's starting credit, in currency units
    credits: {ben: 5}                 # per-student starting credit, where it differs
    prices: {cpu_core_hour: 0.5, gpu_hour: {A100-80G: 7.5}}
    caps: {concurrent_runs: 1, gpus_per_run: 1, hours_per_run: 2, endpoints: 1}
    idle_minutes: 30                  # idle endpoints and students' servers are stopped
    targets: [local]                  # runs on local; others may serve endpoints
    serve_target: local               # where endpoints are served: local (the hub) or a target
    state_dir: /srv/workbench-course  # only the service's user reads it: ledger, runs, prices

``init`` resolves it into ``STATE_DIR/course.json`` (what the service reads),
``STATE_DIR/jupyterhub_config.py`` (what ``workbench course start`` runs) and ``STATE_DIR/sudoers``
(the rule that lets the service start work as each student), all mode 0600 in a 0711 folder:
students' kernels run as their own Unix users and can neither list nor read any of them.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workbench.errors import CourseError

SERVICE_NAME = "course"
SERVICE_POLL_S = 2  # how often the hub looks whether a service it manages is still alive
_AUTHENTICATORS = {"pam": "jupyterhub.auth.PAMAuthenticator",
                   "dummy": "jupyterhub.auth.DummyAuthenticator"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Prices(_Strict):
    cpu_core_hour: float = Field(0.0, ge=0)  # per training process on CPU
    gpu_hour: dict[str, float] = Field(default_factory=dict)  # per card, by GPU type
    default_gpu_hour: float | None = Field(None, ge=0)  # a card of a type not listed
    endpoint_hour: float | None = Field(None, ge=0)  # a deployed endpoint; None: no deploys


class Caps(_Strict):
    concurrent_runs: int = Field(1, ge=1)
    gpus_per_run: int = Field(1, ge=0)
    processes_per_run: int = Field(2, ge=1)  # CPU runs: training processes (cores billed)
    hours_per_run: float = Field(2.0, gt=0)  # the planner's estimate must be under it
    endpoints: int = Field(1, ge=0)  # endpoints up at once, per student
    eval_minutes: float = Field(10.0, gt=0)  # an evaluation is held for (and stopped at) this


class Hub(_Strict):
    ip: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    hub_port: int = Field(8081, ge=1, le=65535)  # the hub's internal API
    proxy_api_port: int = Field(8001, ge=1, le=65535)
    service_port: int = Field(10101, ge=1, le=65535)  # the course service, on loopback
    authenticator: str = "pam"  # pam | dummy (tests only) | a class path, e.g. oauthenticator's
    proxy_command: str | None = None  # configurable-http-proxy; None: .course/ or PATH


class Course(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    instructors: list[str] = Field(min_length=1)
    students: list[str] = Field(default_factory=list)
    currency: str = "CNY"
    minor_per_unit: int = Field(100, ge=1)  # 100: amounts kept in fen/cents
    default_credit: float = Field(10.0, ge=0)
    credits: dict[str, float] = Field(default_factory=dict)
    hold_margin: float = Field(2.0, ge=1.0)  # hold = planned cost x margin; the rest returns
    endpoint_hold_minutes: float = Field(60.0, gt=0)  # an endpoint's time is held in blocks
    idle_minutes: float = Field(30.0, gt=0)  # idle endpoints and students' servers are culled
    prices: Prices = Field(default_factory=Prices)
    caps: Caps = Field(default_factory=Caps)
    targets: list[str] = Field(default_factory=lambda: ["local"])
    # Where students' endpoints are served: the hub machine, or one of ``targets`` (an SSH host,
    # a Slurm partition), through workbench.serve.deploy(target=...).
    serve_target: str = "local"
    # What students' specs may name besides files in their own space (docs/course.md): models
    # and datasets ([]: the built-in ones), judge URLs or endpoint names, and the one
    # environment variable of the service that holds the judges' key.
    models: list[str] = Field(default_factory=list)
    datasets: list[str] = Field(default_factory=list)
    judges: list[str] = Field(default_factory=list)
    judge_key_env: str | None = None
    hardware: dict[str, str] = Field(default_factory=dict)  # target -> GPU type it is priced at
    # The interpreter students' work runs with (None: the service's); every student must be
    # able to run it and import workbench with it.
    student_python: str | None = None
    # The interpreter that runs students' endpoints on the hub machine (vLLM imports with it),
    # as them: every student must be able to run it (None: the serving Python workbench finds,
    # WORKBENCH_SERVE_PYTHON or the checkout's .venv-serve).
    serve_python: str | None = None
    state_dir: str = "/srv/workbench-course"
    database: str | None = None  # a SQLAlchemy URL; None: sqlite in state_dir
    hub: Hub = Field(default_factory=Hub)

    @model_validator(mode="after")
    def _people(self) -> Course:
        both = set(self.instructors) & set(self.students)
        if both:
            raise ValueError(f"{sorted(both)} listed as both instructor and student; keep each "
                             "person in one list")
        unknown = set(self.credits) - set(self.students)
        if unknown:
            raise ValueError(f"credits names {sorted(unknown)}, who are not in students")
        if self.serve_target != "local" and self.serve_target not in self.targets:
            raise ValueError(f"serve_target {self.serve_target!r} is not one of the course's "
                             f"targets ({', '.join(self.targets)}); add it to targets or serve "
                             "on the hub machine (serve_target: local)")
        return self

    # -- derived ---------------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return Path(self.state_dir)

    @property
    def spaces(self) -> Path:
        """Where each student's own space is (workbench.course.students)."""
        return self.state / "students"

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.state / 'ledger.sqlite'}"

    @property
    def service_url(self) -> str:
        return f"http://127.0.0.1:{self.hub.service_port}"

    @property
    def public_service_url(self) -> str:
        return f"http://{self.hub.ip}:{self.hub.port}/services/{SERVICE_NAME}/"

    def starting_credit(self, student: str) -> float:
        return self.credits.get(student, self.default_credit)

    def minor(self, amount: float) -> int:
        from workbench.runs.ledger import to_minor

        return to_minor(amount, self.minor_per_unit)

    def money(self, minor: int) -> str:
        """Minor units for people: ``money(1234) == '12.34 CNY'``."""
        digits = len(str(self.minor_per_unit)) - 1
        return f"{minor / self.minor_per_unit:.{digits}f} {self.currency}"


def load_course(path: str | Path) -> Course:
    """A course file (YAML) or the resolved course.json, validated; CourseError names the field."""
    path = Path(path)
    if not path.is_file():
        raise CourseError(f"course file {path} does not exist; see docs/course.md for an example")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return Course.model_validate(data or {})
    except yaml.YAMLError as exc:
        raise CourseError(f"{path} is not valid YAML: {exc}") from None
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                 for e in exc.errors()]
        raise CourseError(f"invalid course file {path}:\n" + "\n".join(lines)) from None


def proxy_command(course: Course) -> str:
    """configurable-http-proxy: the course file's, else `make course-deps`'s, else PATH's."""
    if course.hub.proxy_command:
        return course.hub.proxy_command
    local = Path(__file__).resolve().parents[2] / ".course/node_modules/.bin/configurable-http-proxy"
    found = str(local) if local.is_file() else shutil.which("configurable-http-proxy")
    if not found:
        raise CourseError("configurable-http-proxy not found: run `make course-deps` (npm) or set "
                          "hub.proxy_command in the course file")
    return found


def hub_config(course: Course) -> str:
    """The text of jupyterhub_config.py for this course."""
    state = course.state
    auth = _AUTHENTICATORS.get(course.hub.authenticator, course.hub.authenticator)
    service = {
        "name": SERVICE_NAME, "url": course.service_url,
        "command": [sys.executable, "-m", "workbench.course.service", str(state / "course.json")],
        "environment": {"WORKBENCH_HOME": str(state / "home"),
                        # the students' interpreter may need its library path (students.py)
                        **{k: os.environ[k] for k in ("LD_LIBRARY_PATH",) if os.environ.get(k)}},
    }
    scope = f"access:services!service={SERVICE_NAME}"
    lines = [
        "# Written by `workbench course init`; edit the course file and run init again.",
        "c = get_config()  # noqa",
        # The hub stops its services and servers with SIGINT, and with SIGTERM only 30 s later.
        # Those it starts before it sets its own handlers inherit its SIGINT disposition: from a
        # hub started with SIGINT ignored (a background job of a script), each would take the
        # 30 s. So the hub's SIGINT is Python's default before it starts anything.
        "import signal",
        "signal.signal(signal.SIGINT, signal.default_int_handler)",
        # The hub sees that a service it manages has died by polling it every
        # Spawner.poll_interval (30 s), and the spawner it makes for a service reads no config:
        # a crashed course service would be down for up to 30 s. The hub makes that spawner
        # from this module attribute when it starts the service, so a subclass polled every
        # SERVICE_POLL_S takes its place (a poll is one os.kill(pid, 0)).
        "from jupyterhub.services import service as _services",
        "from traitlets import Integer",
        "class _ServiceSpawner(_services._ServiceSpawner):",
        f"    poll_interval = Integer({SERVICE_POLL_S})",
        "_services._ServiceSpawner = _ServiceSpawner",
        f"c.JupyterHub.ip = {course.hub.ip!r}",
        f"c.JupyterHub.port = {course.hub.port}",
        "c.JupyterHub.hub_ip = '127.0.0.1'",
        f"c.JupyterHub.hub_port = {course.hub.hub_port}",
        f"c.JupyterHub.db_url = {'sqlite:///' + str(state / 'jupyterhub.sqlite')!r}",
        f"c.JupyterHub.cookie_secret_file = {str(state / 'jupyterhub_cookie_secret')!r}",
        f"c.JupyterHub.pid_file = {str(state / 'jupyterhub.pid')!r}",
        f"c.ConfigurableHTTPProxy.command = [{proxy_command(course)!r}]",
        f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{course.hub.proxy_api_port}'",
        f"c.ConfigurableHTTPProxy.pid_file = {str(state / 'proxy.pid')!r}",
        f"c.JupyterHub.authenticator_class = {auth!r}",
        f"c.Authenticator.allowed_users = {set(course.students) | set(course.instructors)!r}",
        f"c.Authenticator.admin_users = {set(course.instructors)!r}",
        f"c.JupyterHub.services = [{service!r}]",
        # Every user (and their server's token) may call the course service; nothing more.
        f"c.JupyterHub.load_roles = [{{'name': 'user', 'scopes': ['self', {scope!r}]}}]",
        "c.Spawner.server_token_scopes = ['users:activity!user', 'access:servers!server', "
        f"{scope!r}]",
        f"c.Spawner.environment = {{'WORKBENCH_COURSE_URL': {course.public_service_url!r}}}",
        "c.Spawner.default_url = '/lab'",
        *_culler(course),
    ]
    return "\n".join(lines) + "\n"


def _culler(course: Course) -> list[str]:
    """jupyterhub-idle-culler as a hub service: students' servers (and the kernels in them)
    idle longer than ``idle_minutes`` are stopped. Their time is not charged to the credit."""
    import importlib.util

    if importlib.util.find_spec("jupyterhub_idle_culler") is None:
        raise CourseError("jupyterhub-idle-culler is not installed: pip install "
                          "'workbench[course]' (or jupyterhub-idle-culler) into the hub's venv")
    timeout = max(60, round(course.idle_minutes * 60))
    service = {"name": "idle-culler",
               "command": [sys.executable, "-m", "jupyterhub_idle_culler",
                           f"--timeout={timeout}", f"--cull-every={min(300, timeout // 2)}"]}
    role = {"name": "idle-culler", "services": ["idle-culler"],
            "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}
    return [f"c.JupyterHub.services.append({service!r})",
            f"c.JupyterHub.load_roles.append({role!r})"]


def init(course_file: str | Path) -> Path:
    """Validate the course file and write STATE_DIR/{course.json, jupyterhub_config.py}."""
    course = load_course(course_file)
    state = course.state
    state.mkdir(parents=True, exist_ok=True)
    # Students pass through to their own space (students/NAME) and list nothing; every file
    # here is the service's alone (0600).
    os.chmod(state, 0o711)
    (state / "home").mkdir(mode=0o700, exist_ok=True)
    _write_private(state / "course.json", course.model_dump_json(indent=2))
    _write_private(state / "jupyterhub_config.py", hub_config(course))
    from workbench.course.students import sudoers_rule

    _write_private(state / "sudoers", sudoers_rule(course, pwd.getpwuid(os.geteuid()).pw_name))
    secret = state / "jupyterhub_cookie_secret"
    if not secret.exists():
        _write_private(secret, secrets.token_hex(32))
    return state / "jupyterhub_config.py"


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def start(course_file: str | Path) -> int:
    """Run the hub of a course (init first); returns when the hub exits."""
    import subprocess

    config = init(course_file)
    cmd = [sys.executable, "-m", "jupyterhub", "-f", str(config)]
    return subprocess.call(cmd, cwd=config.parent)


def course_json(course: Course) -> dict[str, Any]:
    return json.loads(course.model_dump_json())
