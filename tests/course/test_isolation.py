"""What a curious student tries against a course, and what stops it (docs/course.md, threat model).

The spec gate is a table: each hostile field is refused by name, saying what the course allows.
The rest runs for real: Unix students made with useradd, the worker started through sudo as
them, processes of theirs metered by the service's meter, the ledger's cap at the hold, and the
sudo rule `course init` writes, checked by visudo and used by a service user that is not root.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_for
from workbench.course.config import Course
from workbench.course.meter import Meter
from workbench.course.policy import admit, eval_price, hourly_rate
from workbench.course.students import Worker, ensure_space, read_json, space, sudoers_rule
from workbench.errors import CourseError, CourseSpecError
from workbench.runs.ledger import Ledger

SPACE = "/srv/c/students/ana"


def _course(**over: Any) -> Course:
    return Course.model_validate({
        "name": "c", "instructors": ["t"], "students": ["ana"], "state_dir": "/srv/c",
        "prices": {"cpu_core_hour": 2.0, "gpu_hour": {"A100-80G": 7.5, "T4": 0.5}},
        "caps": {"gpus_per_run": 2}, **over})


@pytest.mark.parametrize("spec, field", [
    ({"model": {"trust_remote_code": True}}, "model.trust_remote_code"),
    ({"model": {"id": "/home/ben/model"}}, "model.id"),
    ({"model": {"id": f"{SPACE}/../ben/model"}}, "model.id"),
    ({"model": {"id": "Qwen/Qwen2.5-7B"}}, "model.id"),  # a hub id the course does not list
    ({"data": {"sources": [{"path": "/srv/c/home/runs/x/data/train.jsonl"}]}},
     "data.sources.0.path"),
    ({"data": {"sources": [{"path": "builtin:teaching"}, {"path": "../ben/d.jsonl"}]}},
     "data.sources.1.path"),
    ({"data": {"sources": [{"path": "train.jsonl"}]}}, "data.sources.0.path"),  # relative
    ({"method": {"stage": "grpo", "rewards": [{"fn": "mymodule:score"}]},
      "data": {"sources": [{"path": "builtin:teaching"}]}}, "method.rewards.0.fn"),
    ({"eval": {"tasks": [{"kind": "judge", "judge": "http://evil.example/v1"}]}},
     "eval.tasks.0.judge"),
    ({"eval": {"tasks": [{"kind": "judge", "judge": "http://judge.course/v1",
                          "api_key_env": "JUPYTERHUB_API_TOKEN"}]}}, "eval.tasks.0.api_key_env"),
    ({"eval": {"tasks": [{"kind": "heldout", "file": "/srv/c/students/ben/q.jsonl"}]}},
     "eval.tasks.0.file"),
    ({"eval": {"tasks": [{"kind": "lm_eval", "tasks": ["/tmp/evil/task.yaml"]}]}},
     "eval.tasks.0.tasks"),
    ({"serve": {"python": "/tmp/evil/python"}}, "serve.python"),
    ({"checkpoint": {"storage": "s3://bucket/x"}}, "checkpoint.storage"),
    ({"checkpoint": {"storage": "/srv/c/home/runs"}}, "checkpoint.storage"),
    ({"tracking": {"wandb": "online"}}, "tracking.wandb"),
])
def test_a_hostile_field_is_refused_by_name(spec: dict, field: str) -> None:
    course = _course(judges=["http://judge.course/v1"], judge_key_env="COURSE_JUDGE_KEY")
    with pytest.raises(CourseSpecError) as refused:
        admit(course, SPACE, spec)
    assert field in [p for p, _ in refused.value.problems], refused.value.problems
    assert isinstance(refused.value, CourseError)


def test_the_students_own_files_and_the_courses_lists_are_allowed() -> None:
    course = _course(judges=["http://judge.course/v1"], judge_key_env="COURSE_JUDGE_KEY",
                     models=["builtin:tiny-llama", "Qwen/Qwen2.5-0.5B"])
    spec = admit(course, SPACE, {
        "model": {"id": "Qwen/Qwen2.5-0.5B"},
        "data": {"sources": [{"path": f"{SPACE}/data/train.jsonl"},
                             {"path": f"{SPACE}/more.csv"}]},
        "eval": {"tasks": [{"kind": "judge", "judge": "http://judge.course/v1",
                            "api_key_env": "COURSE_JUDGE_KEY", "file": f"{SPACE}/q.jsonl"}]},
        "checkpoint": {"storage": f"{SPACE}/snaps"}})
    assert spec.model.id == "Qwen/Qwen2.5-0.5B"
    assert admit(course, SPACE, {"model": {"id": f"{SPACE}/my-model"}}).model.id.endswith(
        "my-model")


@pytest.mark.parametrize("spec", ["/srv/c/home/runs/x/spec.yaml", "name: x\n", ["name", "x"]])
def test_a_spec_given_as_a_path_or_text_is_refused(spec: Any) -> None:
    with pytest.raises(CourseError, match="as a mapping"):
        admit(_course(), SPACE, spec)


def test_the_price_is_the_targets_hardware_never_the_students_word() -> None:
    course = _course(hardware={"local": "A100-80G"})
    priced = admit(course, SPACE, {"resources": {"gpus_per_node": 1}})
    assert priced.resources.gpu_type == "A100-80G" and priced.budget.price_per_gpu_hour == 7.5
    with pytest.raises(CourseError, match="the cards of local are A100-80G"):
        admit(course, SPACE, {"resources": {"gpus_per_node": 1, "gpu_type": "T4"}})


def test_a_gpu_run_on_a_target_without_a_known_gpu_is_refused() -> None:
    if _has_gpu():
        pytest.skip("this machine has a GPU: the local target's cards are known")
    with pytest.raises(CourseError, match="has no GPU this course knows of"):
        admit(_course(), SPACE, {"resources": {"gpus_per_node": 1}})


def _has_gpu() -> bool:
    from workbench.targets.gpus import detect_gpu_type

    return detect_gpu_type() is not None


def test_the_evaluation_beside_a_gpu_run_is_a_card_billed_and_capped() -> None:
    course = _course(hardware={"local": "A100-80G"}, caps={"gpus_per_run": 1})
    with pytest.raises(CourseError, match=r"asks for 2 GPUs \(one of them for eval.every_steps\)"):
        admit(course, SPACE, {"resources": {"gpus_per_node": 1}, "eval": {"every_steps": 5}})
    wide = _course(hardware={"local": "A100-80G"}, caps={"gpus_per_run": 2})
    both = admit(wide, SPACE, {"resources": {"gpus_per_node": 1}, "eval": {"every_steps": 5}})
    assert hourly_rate(both) == pytest.approx(15.0)  # two cards at 7.5
    alone = admit(wide, SPACE, {"resources": {"gpus_per_node": 1}})
    assert hourly_rate(alone) == pytest.approx(7.5)
    # Scoring an ended run holds the run's own card, not the spare one.
    assert eval_price(wide, both)[0] == pytest.approx(7.5)


def test_endpoint_names_of_two_students_never_meet() -> None:
    from workbench.course.endpoints import _endpoint_name

    assert f"{_endpoint_name('b-x')}.ana" != f"{_endpoint_name('x')}.ana-b"
    with pytest.raises(CourseError, match="no dots"):
        _endpoint_name("x.ana")


def test_a_charge_never_passes_its_hold(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}")
    ledger.open_account("ana", 1000, actor="t")
    hold = ledger.hold("ana", 300, actor="ana")
    assert ledger.settle(hold, 5000, actor="service")
    assert ledger.account("ana").charges == 300 and ledger.balance("ana") == 700


# -- as the student, for real ------------------------------------------------------------------
def test_the_worker_runs_as_the_student_in_their_own_space(classroom: dict) -> None:
    course = classroom["course"]()
    ana, ben = classroom["users"]["ana"], classroom["users"]["ben"]
    answer = Worker(course, ana, {"verb": "whoami"}).answer(timeout=120)
    assert answer["user"] == ana
    home = space(course, ana)
    assert answer["home"] == str(home / "workbench")
    st = home.stat()
    assert st.st_uid == pwd.getpwnam(ana).pw_uid and oct(st.st_mode & 0o7777) == "0o2750"
    # Ben can neither list nor enter ana's space.
    peek = subprocess.run(["runuser", "-u", ben, "--", "ls", str(home)], capture_output=True,
                          text=True)
    assert peek.returncode != 0 and "Permission denied" in peek.stderr
    # The worker refuses a space that is not its user's (the service named ben's for ana).
    ensure_space(course, ben)
    request = {"verb": "whoami", "space": str(space(course, ben)), "env": {}}
    rc, out, _err, _s = _raw(course, ana, request)
    assert rc != 0 and "is not this user's space" in out


def _raw(course: Course, student: str, request: dict) -> tuple[int, str, str, float]:
    w = Worker(course, student, {"verb": "whoami"})
    w.request = request
    return w.run(timeout=120)


def test_a_model_folder_with_remote_code_never_runs_as_the_service(classroom: dict,
                                                                   tmp_path: Path) -> None:
    """A student's model folder whose config asks for remote code: the service refuses the
    field by name; were the field not set, the folder is only ever opened by the student's own
    processes: the quote runs as the student (a marker its code would write is the student's)."""
    course = classroom["course"]()
    ana = classroom["users"]["ana"]
    folder = ensure_space(course, ana) / "evil-model"
    with pytest.raises(CourseSpecError, match="model.trust_remote_code"):
        admit(course, str(space(course, ana)), {"model": {"id": str(folder),
                                                          "trust_remote_code": True}})
    marker = Path(f"/tmp/wb-marker-{secrets.token_hex(4)}")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    os.chown(folder, pwd.getpwnam(ana).pw_uid, -1)
    priced = admit(course, str(space(course, ana)), {"model": {"id": str(folder)}})
    with pytest.raises(CourseError):
        Worker(course, ana, {"verb": "quote", "spec": priced.model_dump(mode="json")}).answer(
            timeout=300)
    if marker.exists():  # had it run at all, it ran as ana, never as the service
        assert marker.stat().st_uid == pwd.getpwnam(ana).pw_uid
        marker.unlink()


def test_the_sudo_rule_lets_the_service_run_the_worker_and_nothing_else(classroom: dict) -> None:
    course = classroom["course"]()
    ana = classroom["users"]["ana"]
    ensure_space(course, ana)
    svc = f"wbsvc{secrets.token_hex(3)}"
    subprocess.run(["useradd", "-M", "-s", "/bin/bash", svc], check=True)
    rule = Path(f"/etc/sudoers.d/wb-test-{secrets.token_hex(3)}")
    try:
        text = sudoers_rule(course, svc)
        check = subprocess.run(["visudo", "-cf", "-"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        rule.write_text(text)
        rule.chmod(0o440)
        # The service's user may hand the space to... ana's worker, as ana.
        os.chown(space(course, ana), pwd.getpwnam(ana).pw_uid, pwd.getpwnam(svc).pw_gid)
        request = json.dumps({"verb": "whoami", "space": str(space(course, ana)), "env": {}})
        worker = [course.student_python or "", "-I", "-m", "workbench.course.worker"]
        ok = subprocess.run(["runuser", "-u", svc, "--", "sudo", "-n", "-u", ana, "--", *worker],
                            input=request, capture_output=True, text=True, timeout=120,
                            env={**os.environ})
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout.splitlines()[-1])["user"] == ana
        for argv in (["-u", ana, "--", "/bin/id"],  # any other command
                     ["-u", ana, "--", course.student_python or "", "-c", "print(1)"],
                     ["-u", "root", "--", *worker]):  # the worker as anyone not a student
            no = subprocess.run(["runuser", "-u", svc, "--", "sudo", "-n", *argv],
                                input=request, capture_output=True, text=True, timeout=60)
            assert no.returncode != 0 and "password is required" in no.stderr, (argv, no)
    finally:
        rule.unlink(missing_ok=True)
        subprocess.run(["userdel", svc], check=False, capture_output=True)


def _as(user: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(["runuser", "-u", user, "--", *argv], start_new_session=True)


def _child_of(proc: subprocess.Popen, user: str) -> Any:
    """runuser's child once it runs as ``user`` (it forks before it switches)."""
    import psutil

    uid = pwd.getpwnam(user).pw_uid

    def ready() -> Any:
        for child in psutil.Process(proc.pid).children():
            if child.uids().real == uid:
                return child
        return None

    return wait_for(ready, 30, f"runuser's child to run as {user}")


def _student_process(user: str, seconds: int = 600) -> tuple[subprocess.Popen, int]:
    """A process of ``user``'s (runuser's child), and its pid."""
    proc = _as(user, "sleep", str(seconds))
    return proc, _child_of(proc, user).pid


def test_the_meter_bills_what_it_saw_and_ends_with_the_last_process(classroom: dict) -> None:
    import psutil

    course = classroom["course"](prices={"cpu_core_hour": 3600})  # 1 currency unit a second
    ana = classroom["users"]["ana"]
    uid = pwd.getpwnam(ana).pw_uid
    meter = Meter(course)
    proc, pid = _student_process(ana)
    started = time.time()
    a = meter.begin(1, ana, uid, "r1", pid, rate=3600.0, hold=100_000)
    assert meter.tick() == [] and a.procs == [(pid, psutil.Process(pid).create_time())]
    psutil.Process(pid).kill()
    proc.wait()
    [ended] = wait_for(lambda: meter.tick() or None, 30, "the meter to see the end")
    assert ended.end is not None and started <= ended.start <= ended.end <= time.time()
    recomputed = math.ceil(round(3600.0 * (ended.end - ended.start) / 3600 * 100, 6))
    assert meter.bill(ended) == recomputed


def test_the_meter_refuses_a_process_that_is_not_the_students(classroom: dict) -> None:
    course = classroom["course"]()
    ana, ben = classroom["users"]["ana"], classroom["users"]["ben"]
    proc, pid = _student_process(ben)
    try:
        with pytest.raises(CourseError, match="is not .*'s"):
            Meter(course).begin(2, ana, pwd.getpwnam(ana).pw_uid, "r2", pid, 1.0, 100)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_an_attempt_that_would_pass_its_hold_is_stopped_and_charged_the_hold(
        classroom: dict) -> None:
    """A student's process that ignores TERM (as a run whose budget stop was tampered with
    would): the meter ends it with KILL and the bill stops at the hold."""
    from workbench.course.meter import GRACE_S, KILL_MARGIN_S

    course = classroom["course"]()
    ana = classroom["users"]["ana"]
    proc = _as(ana, "bash", "-c", "trap '' TERM; while true; do sleep 1; done")
    child = _child_of(proc, ana)
    meter = Meter(course)
    # A hold of 1.00 at 36 an hour: 100 s of time; the meter stops it 20 s before.
    a = meter.begin(3, ana, pwd.getpwnam(ana).pw_uid, "r3", child.pid, rate=36.0, hold=100)
    t0 = a.start
    deadline = t0 + 100 - KILL_MARGIN_S
    assert meter.tick(now=deadline - 1) == []  # before the deadline: left alone
    meter.tick(now=deadline)  # TERM, which it ignores
    assert child.is_running()
    meter.tick(now=deadline + GRACE_S)  # KILL
    [ended] = wait_for(lambda: meter.tick(now=deadline + GRACE_S + 1) or None, 30, "its end")
    assert ended.why == "stopped by the course at its hold"
    assert meter.bill(ended) <= 100
    proc.wait(timeout=30)


def test_a_link_to_another_students_file_reads_as_nothing(classroom: dict) -> None:
    course = classroom["course"]()
    ana, ben = classroom["users"]["ana"], classroom["users"]["ben"]
    bens = ensure_space(course, ben) / "status.json"
    bens.write_text(json.dumps({"state": "running", "secret": "ben's"}))
    os.chown(bens, pwd.getpwnam(ben).pw_uid, -1)
    anas = ensure_space(course, ana)
    (anas / "status.json").symlink_to(bens)
    assert read_json(str(anas / "status.json"), ana) == {}
    own = anas / "mine.json"
    own.write_text(json.dumps({"state": "succeeded"}))
    os.chown(own, pwd.getpwnam(ana).pw_uid, -1)
    assert read_json(str(own), ana) == {"state": "succeeded"}
    assert read_json(str(bens), ana) == {}  # ben's own file, asked for as ana's


def _adapter(course: Course, student: str, base: str = "builtin:tiny-llama") -> Path:
    """A run folder of the student's with a peft adapter in it (the files save_pretrained
    writes; vLLM is not started, so the weights' bytes are not read as a model)."""
    run = ensure_space(course, student) / "runs" / f"r-{secrets.token_hex(3)}"
    adapter = run / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": base, "r": 4, "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights of " + student.encode())
    uid = pwd.getpwnam(student).pw_uid
    for p in [run.parent, run, adapter, *adapter.iterdir()]:
        os.chown(p, uid, -1, follow_symlinks=False)
    return run


def test_an_endpoint_serves_copies_of_the_students_own_files_and_nothing_through_a_link(
        classroom: dict, tmp_path: Path) -> None:
    """The serving plan is made as the student; the service serves its own copies of the
    student's files, refusing a link, another's file or a base that is not the course's."""
    from workbench.course.serving import copies, student_plan
    from workbench.spec.models import resolve_model

    course = classroom["course"]()
    ana, ben = classroom["users"]["ana"], classroom["users"]["ben"]
    run = _adapter(course, ana)
    plan = copies(course, ana, student_plan(course, ana, [str(run / "adapter")]), tmp_path / "ok")
    assert plan.model == resolve_model("builtin:tiny-llama")
    served = plan.adapters[0].path
    assert served.parent == tmp_path / "ok"
    assert (served / "adapter_model.safetensors").read_bytes() == b"weights of " + ana.encode()
    assert served.stat().st_uid == os.geteuid()  # the service's copy, not the student's file

    # Ben's secret, which ana's links point at.
    secret = ensure_space(course, ben) / "secret.jinja"
    secret.write_text("ben's private data")
    os.chown(secret, pwd.getpwnam(ben).pw_uid, -1)
    linked = _adapter(course, ana)
    (linked / "adapter" / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(CourseError, match="chat_template.jinja cannot be read by you"):
        copies(course, ana, student_plan(course, ana, [str(linked / "adapter")]), tmp_path / "link")
    assert not any("ben's" in p.read_text(errors="replace")
                   for p in (tmp_path / "link").rglob("*") if p.is_file())
    # A link ana may follow herself (to her own file) is still not copied through.
    own = _adapter(course, ana)
    (own / "adapter" / "chat_template.jinja").symlink_to(own / "adapter" / "adapter_config.json")
    with pytest.raises(CourseError, match="chat_template.jinja is a link"):
        copies(course, ana, student_plan(course, ana, [str(own / "adapter")]), tmp_path / "own")

    # A base that is ben's model folder (or any folder outside ana's space) is not served.
    bens_model = ensure_space(course, ben) / "model"
    bens_model.mkdir()
    (bens_model / "config.json").write_text("{}")
    foreign = _adapter(course, ana, base=str(bens_model))
    with pytest.raises(CourseError, match="model cannot be read by you"):
        copies(course, ana, student_plan(course, ana, [str(foreign / "adapter")]), tmp_path / "foreign")
    elsewhere = classroom["root"] / f"model-{secrets.token_hex(3)}"  # ana may read it
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    outside = _adapter(course, ana, base=str(elsewhere))
    with pytest.raises(CourseError, match="neither one of the course's models .* nor a folder"):
        copies(course, ana, student_plan(course, ana, [str(outside / "adapter")]), tmp_path / "out")

    # A file in ana's adapter that is not hers (put there by someone else) is not copied.
    planted = _adapter(course, ana)
    (planted / "adapter" / "extra.bin").write_bytes(b"root's")  # owned by the test's root
    with pytest.raises(CourseError, match="extra.bin is not the student's own file"):
        copies(course, ana, student_plan(course, ana, [str(planted / "adapter")]), tmp_path / "planted")
