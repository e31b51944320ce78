"""The course file: init writes private configs a hub can load; the course's prices and caps
replace whatever a student's spec says."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import pytest
import yaml
from jupyterhub.services import service as services

from workbench.course.config import init, load_course
from workbench.course.policy import priced_spec
from workbench.errors import CourseError
from workbench.spec import RunSpec


def _course(tmp_path: Path, **over: object) -> Path:
    data = {"name": "c1", "instructors": ["t"], "students": ["ana", "ben"],
            "prices": {"cpu_core_hour": 2.0, "gpu_hour": {"A100-80G": 7.5}},
            "caps": {"gpus_per_run": 1, "processes_per_run": 2}, "idle_minutes": 2,
            "state_dir": str(tmp_path / "state"), "hub": {"proxy_command": "/bin/true"}, **over}
    path = tmp_path / "course.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_init_writes_private_files_the_hub_can_load(tmp_path: Path) -> None:
    config = init(_course(tmp_path))
    state = config.parent
    # Students pass through to their own spaces; they list nothing and read none of these.
    assert stat.S_IMODE(state.stat().st_mode) == 0o711
    for name in ("course.json", "jupyterhub_config.py", "jupyterhub_cookie_secret", "sudoers"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name

    class _Cfg(dict):  # what traitlets' get_config() returns, enough to execute the file
        def __getattr__(self, key: str) -> _Cfg:
            return self.setdefault(key, _Cfg())

        def __setattr__(self, key: str, value: object) -> None:
            self[key] = value

    c = _Cfg()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job of a script
    spawner = services._ServiceSpawner
    try:
        exec(config.read_text(), {"get_config": lambda: c})
        # The services the hub starts inherit this, and the hub stops them with SIGINT.
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # The hub sees a dead service within the 2 s docs/course.md says, not its default 30 s.
        assert services._ServiceSpawner is not spawner
        assert services._ServiceSpawner(cmd=["true"]).poll_interval <= 2
    finally:
        signal.signal(signal.SIGINT, before)
        services._ServiceSpawner = spawner
    service, culler = c["JupyterHub"]["services"]
    assert service["name"] == "course" and str(state / "course.json") in service["command"]
    # The course file's idle_minutes (2) is the culler's --timeout, in seconds.
    assert culler["name"] == "idle-culler" and "--timeout=120" in culler["command"]
    [role] = [r for r in c["JupyterHub"]["load_roles"] if r["name"] == "idle-culler"]
    assert "delete:servers" in role["scopes"] and role["services"] == ["idle-culler"]
    assert c["Authenticator"]["allowed_users"] == {"t", "ana", "ben"}
    assert c["Authenticator"]["admin_users"] == {"t"}
    assert load_course(state / "course.json").students == ["ana", "ben"]


def test_endpoints_are_served_on_the_hub_unless_the_course_names_one_of_its_targets(
        tmp_path: Path) -> None:
    assert load_course(_course(tmp_path)).serve_target == "local"
    course = load_course(_course(tmp_path, targets=["local", "slurm:gpu"],
                                 serve_target="slurm:gpu"))
    assert course.serve_target == "slurm:gpu"


@pytest.mark.parametrize("over, words", [
    ({"students": ["t"]}, "both instructor and student"),
    ({"credits": {"eve": 3}}, "not in students"),
    ({"caps": {"gpus_per_run": -1}}, "caps.gpus_per_run"),
    ({"pricez": {}}, "pricez"),
    # Endpoints are served only where the course's runs may go (or on the hub machine).
    ({"targets": ["local", "ssh:lab"], "serve_target": "slurm:gpu"},
     "serve_target 'slurm:gpu' is not one of the course's targets"),
])
def test_bad_course_files_name_the_problem(tmp_path: Path, over: dict, words: str) -> None:
    with pytest.raises(CourseError, match=words):
        load_course(_course(tmp_path, **over))


def test_the_course_prices_every_run_whatever_the_spec_says(tmp_path: Path) -> None:
    course = load_course(_course(tmp_path))
    cheeky = RunSpec(budget={"price_per_cpu_core_hour": 0, "limit": 1e9, "currency": "USD"})
    priced = priced_spec(course, cheeky)
    assert priced.budget.price_per_cpu_core_hour == 2.0
    assert priced.budget.limit is None and priced.budget.currency == "CNY"
    gpu = priced_spec(load_course(_course(tmp_path, hardware={"local": "A100-80G"})),
                      RunSpec(resources={"gpus_per_node": 1, "gpu_type": "A100-80G"},
                              budget={"price_per_gpu_hour": 0.01}))
    assert gpu.budget.price_per_gpu_hour == 7.5


@pytest.mark.parametrize("spec, words", [
    ({"resources": {"gpus_per_node": 2, "gpu_type": "A100-80G"}}, "allows 1 per run"),
    ({"resources": {"processes_per_node": 4}}, "4 CPU processes"),
    ({"resources": {"gpus_per_node": 1}}, "no price for GPU type 'H100'"),
    ({"target": "slurm:big"}, "not one of this course's targets"),
])
def test_specs_over_a_cap_are_refused(tmp_path: Path, spec: dict, words: str) -> None:
    course = load_course(_course(tmp_path, hardware={"local": "H100"}))
    with pytest.raises(CourseError, match=words):
        priced_spec(course, RunSpec.parse(spec))


def test_a_run_on_a_target_the_service_cannot_meter_is_refused(tmp_path: Path) -> None:
    """A course may serve endpoints on an SSH host or a Slurm partition, but its runs and sweeps
    run on the hub machine, where the service sees their processes: a launch on the remote
    target is refused by name instead of being billed the seconds its submission took."""
    course = load_course(_course(tmp_path, targets=["local", "ssh:lab"], serve_target="ssh:lab"))
    with pytest.raises(CourseError, match="target 'ssh:lab': a course's runs and sweeps run on"):
        priced_spec(course, RunSpec.parse({"target": "ssh:lab"}))
    assert priced_spec(course, RunSpec.parse({})).target == "local"
