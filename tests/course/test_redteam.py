"""Red team: a student of a real class (tests/course/conftest.py: JupyterHub, the course service,
real Unix users, the real sudo rule) tries to run code or read files with the service's rights,
to pay less than what ran, to spend past the credit or to crash the service. Each attack is
refused (400 naming the field, 402, 403) or harmless, and moves no money but what ran.

The class is this module's own (students ``a``, ``a-b``, ``b`` and ``race``, an instructor).
After every test that spends, and once more when the module ends, :func:`_reconciled` checks
the money: every hold settled once, every balance equal to credit + grants - the bills
recomputed here from the attempt times the service's meter recorded, at the course's price,
and none negative.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.course.conftest import http, running_hub, service_pids, wait_until
from workbench.runs.ledger import Ledger

pytestmark = pytest.mark.slow
PRICE = 36.0  # CNY a CPU core-hour: 1 fen a second
JUDGE = "http://judge.course.invalid/v1"
SMALL_RUN = {"name": "small", "train": {"max_steps": 6, "eval_every": 0},
             "resources": {"processes_per_node": 1},
             "data": {"sources": [{"max_rows": 48}], "eval_samples": 8}}
SECRET = "ben-s-secret-answer"


def _class(users: dict[str, str]) -> dict[str, Any]:
    return {"name": "redteam", "instructors": [users["teacher"]],
            "students": [users[k] for k in ("a", "ab", "b", "race")], "currency": "CNY",
            "default_credit": 20, "credits": {users["race"]: 0.01}, "hold_margin": 10,
            "prices": {"cpu_core_hour": PRICE, "gpu_hour": {"A100-80G": 7.5, "T4": 0.5},
                       "endpoint_hour": 1000},
            "hardware": {"local": "A100-80G"},  # the host's cards, whatever a spec says
            "judges": [JUDGE], "judge_key_env": "COURSE_JUDGE_KEY", "idle_minutes": 5,
            "caps": {"concurrent_runs": 2, "processes_per_run": 1, "hours_per_run": 1,
                     "gpus_per_run": 1, "eval_minutes": 5}}


def _as(rt: dict[str, Any], key: str, script: str) -> None:
    """Run ``script`` (bash) as student ``key``'s Unix user, as their kernel would."""
    subprocess.run(["runuser", "-u", rt["users"][key], "--", "bash", "-c", script], check=True,
                   cwd="/")


@pytest.fixture(scope="module")
def rt(students_reach: list) -> Iterator[dict[str, Any]]:
    """The class; B's own data file in B's space, A's links and files aimed at it and at the
    service, made by A's own user."""
    from workbench.course.config import load_course
    from workbench.course.students import ensure_space

    people = {"a": "a", "ab": "a-b", "b": "b", "race": "r", "teacher": "t"}
    with running_hub(people, _class, prefix="wbr") as info:
        course = load_course(info["course_json"])
        spaces = {k: ensure_space(course, info["users"][k]) for k in ("a", "b")}
        info["spaces"] = spaces
        _as(info, "b", f"echo '{{\"prompt\": \"q\", \"response\": \"{SECRET}\"}}' "
                       f"> {spaces['b']}/data.jsonl")
        # A service-owned status file, where a student's link might lead the service.
        secret_run = info["state"] / "home" / "runs" / "secret"
        secret_run.mkdir(parents=True)
        (secret_run / "status.json").write_text(json.dumps({"state": SECRET}))
        a = spaces["a"]
        _as(info, "a", f"ln -s {spaces['b']}/data.jsonl {a}/q.jsonl; "
                       f"ln -s {info['state']}/ledger.sqlite {a}/ledger.jsonl; "
                       f"ln -s {info['state']}/home {a}/snaps; mkdir {a}/evil-model; "
                       f"printf 'task: evil\\ndataset_path: json\\n"
                       f"process_docs: !function evil.docs\\n' > {a}/evil.yaml")
        yield info
        _reconciled(info)


@pytest.fixture(scope="module")
def a_run(rt: dict[str, Any]) -> str:
    """A run of A's (its processes may still run): what the other students go after."""
    code, answer = http("POST", rt["service"] + "launch", rt["tokens"]["a"], SMALL_RUN)
    assert code == 201, answer
    return str(answer["run"])


def _ledger(rt: dict[str, Any]) -> Ledger:
    return Ledger(f"sqlite:///{rt['state'] / 'ledger.sqlite'}")


def _books(rt: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every ledger row, and every run and sweep folder on disk (the service's and students')."""
    folders = [rt["state"] / "home" / "runs", rt["state"] / "home" / "sweeps",
               *(rt["state"] / "students").glob("*/workbench/runs"),
               *(rt["state"] / "students").glob("*/workbench/sweeps")]
    return _ledger(rt).entries(), sorted(str(p) for f in folders if f.exists()
                                         for p in f.iterdir())


def _bill(rt: dict[str, Any], hold: dict[str, Any]) -> int:
    """A hold's bill from what the service's meter recorded (its start and end of the attempt)
    at the course's price for one CPU process; 0 when it metered nothing (the launch failed)."""
    seen_file = rt["state"] / "meters" / f"{hold['id']}.json"
    if not seen_file.exists():
        return 0
    seen = json.loads(seen_file.read_text())
    fen = PRICE * (seen["end"] - seen["start"]) / 3600 * 100
    return min(hold["amount"], math.ceil(round(fen, 6)))


def _reconciled(rt: dict[str, Any]) -> None:
    """Once every hold is settled: each settled once, and each balance (the instructor's view)
    equal to credit + grants - the bills recomputed from the meter's times, never negative."""
    ledger = _ledger(rt)
    wait_until("every hold to settle", lambda: not ledger.holds(open_only=True), 600, rt["log"])
    # A service the hub has just restarted answers through the proxy once it listens (503 before).
    code, table = wait_until(
        "the service to answer the instructor",
        lambda: (lambda r: r if r[0] != 503 else None)(
            http("GET", rt["service"] + "students", rt["tokens"]["teacher"])), 120, rt["log"])
    assert code == 200, table
    balances = {row["student"]: row["balance"] for row in table["students"]}
    kinds = {h.hold_id: h.kind for h in ledger.holds()}
    for student in ledger.students():
        rows = ledger.entries(student)
        start = sum(r["amount"] for r in rows if r["kind"] in ("credit", "grant"))
        bills = 0
        for hold in (r for r in rows if r["kind"] == "hold"):
            assert kinds[hold["id"]] in (None, "launch", "resume"), kinds  # runs only here
            settled = sorted(r["kind"] for r in rows if r["hold_id"] == hold["id"])
            assert settled == ["charge", "release"], (student, hold, rows)
            bills += _bill(rt, hold)
        assert balances[student] == start - bills >= 0, (student, rows)


def _fill(obj: Any, names: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return obj.format(**names)
    if isinstance(obj, dict):
        return {k: _fill(v, names) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, names) for v in obj]
    return obj


def _names(rt: dict[str, Any], run: str = "") -> dict[str, str]:
    return {"a": str(rt["spaces"]["a"]), "b": str(rt["spaces"]["b"]), "run": run,
            "home": str(rt["state"] / "home"), "bname": rt["users"]["b"],
            "aname": rt["users"]["a"], "abname": rt["users"]["ab"]}


def _refused(rt: dict[str, Any], key: str, method: str, route: str, body: Any, code: int,
             words: str) -> None:
    """``key``'s request is refused with ``code`` and a message with ``words``, no traceback;
    no ledger row is written and no run or sweep folder appears."""
    before = _books(rt)
    got, answer = http(method, rt["service"] + route, rt["tokens"].get(key, key), body)
    assert got == code and isinstance(answer, dict), (
        got, answer, rt["log"].read_text(errors="replace")[-3000:])
    assert words in answer["message"] and "Traceback" not in json.dumps(answer), answer
    assert _books(rt) == before


# -- the spec: nothing a student writes runs or is read with the service's rights ---------------
SPEC_ATTACKS = [
    ("remote code in a model folder", {"model": {"id": "{a}/evil-model",
                                                 "trust_remote_code": True}},
     "model.trust_remote_code"),
    ("an interpreter to serve with", {"serve": {"python": "/tmp/evil-python"}}, "serve.python"),
    ("a reward module", {"method": {"stage": "grpo", "rewards": [{"fn": "evil:score"}]},
                         "data": {"sources": [{"path": "builtin:teaching"}]}},
     "method.rewards.0.fn"),
    ("a judge URL of the student's", {"eval": {"tasks": [
        {"kind": "judge", "judge": "http://attacker.invalid/v1"}]}}, "eval.tasks.0.judge"),
    ("the service's hub token as the judge's key", {"eval": {"tasks": [
        {"kind": "judge", "judge": JUDGE, "api_key_env": "JUPYTERHUB_API_TOKEN"}]}},
     "eval.tasks.0.api_key_env"),
    ("another student's file sent to the judge", {"eval": {"tasks": [
        {"kind": "judge", "judge": JUDGE, "file": "{b}/data.jsonl"}]}}, "eval.tasks.0.file"),
    ("another student's data", {"data": {"sources": [{"path": "{b}/data.jsonl"}]}},
     "data.sources.0.path"),
    ("another student's data through ..", {"data": {"sources": [
        {"path": "{a}/../{bname}/data.jsonl"}]}}, "data.sources.0.path"),
    ("the service's own runs as data", {"data": {"sources": [
        {"path": "{home}/runs/secret/status.json"}]}}, "data.sources.0.path"),
    ("an lm-eval task file of another's", {"eval": {"tasks": [
        {"kind": "lm_eval", "tasks": ["{b}/task.yaml"]}]}}, "eval.tasks.0.tasks"),
    ("snapshots written into the service's home", {"checkpoint": {"storage": "{home}/runs"}},
     "checkpoint.storage"),
    ("a cheaper GPU type than the host's", {"resources": {"gpus_per_node": 1,
                                                          "gpu_type": "T4"}},
     "resources.gpu_type"),
    ("the evaluation's spare card, unbilled", {"resources": {"gpus_per_node": 1},
                                               "eval": {"every_steps": 2}}, "eval.every_steps"),
    ("more processes than the cap", {"resources": {"processes_per_node": 4}},
     "resources.processes_per_node"),
    ("a target the course does not offer", {"target": "ssh:elsewhere"}, "target"),
    ("an unknown field", {"train": {"learning_rate": 1}}, "learning_rate"),
    ("a run logged to an outside service", {"tracking": {"wandb": "online"}}, "tracking.wandb"),
]


@pytest.mark.parametrize("attack, spec, field", SPEC_ATTACKS, ids=[a[0] for a in SPEC_ATTACKS])
def test_a_launch_that_reaches_past_the_student_is_refused_by_name(
        rt: dict[str, Any], attack: str, spec: dict[str, Any], field: str) -> None:
    _refused(rt, "a", "POST", "launch", _fill(spec, _names(rt)), 400, field)


@pytest.mark.parametrize("attack, spec, field", SPEC_ATTACKS, ids=[a[0] for a in SPEC_ATTACKS])
def test_a_sweep_that_reaches_past_the_student_is_refused_by_name(
        rt: dict[str, Any], attack: str, spec: dict[str, Any], field: str) -> None:
    """A sweep's trials run as the student, admitted like a launch: the same spec is refused by
    the same field before anything is held."""
    body = {"spec": {**SMALL_RUN, **_fill(spec, _names(rt))},
            "space": {"train.lr": [1e-3, 2e-3]}, "options": {"budget": 1}}
    _refused(rt, "a", "POST", "sweep", body, 400, field)


def test_a_model_folders_remote_code_never_runs_as_the_service(rt: dict[str, Any]) -> None:
    """A's model folder whose config asks for remote code (auto_map): refused by name with the
    flag; without it the folder is opened only by A's own processes (its code, had it run,
    would have written a file as A), and nothing is held."""
    folder, marker = rt["spaces"]["a"] / "evil-model", Path(f"/tmp/wbr-marker-{os.getpid()}")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for path in (folder / "config.json", folder / "evil.py"):
        os.chown(path, pwd.getpwnam(rt["users"]["a"]).pw_uid, -1)  # A's own files
    spec = {**SMALL_RUN, "model": {"id": str(folder)}}
    _refused(rt, "a", "POST", "quote", {**spec, "model": {"id": str(folder),
                                                          "trust_remote_code": True}},
             400, "model.trust_remote_code")
    before = _books(rt)
    code, answer = http("POST", rt["service"] + "quote", rt["tokens"]["a"], spec)
    assert code in (200, 400) and _books(rt) == before, answer
    if marker.exists():  # had it run at all, it ran as A, never as the service
        assert marker.stat().st_uid == pwd.getpwnam(rt["users"]["a"]).pw_uid
        marker.unlink()


# -- the service's HTTP API: bad input is a 400, others' things a 403 ---------------------------
HTTP_ATTACKS = [
    ("spec as a path to /sweep", "a", "POST", "sweep",
     {"spec": "{home}/runs/secret/spec.yaml", "space": {"train.lr": [1e-3]}}, 400, "mapping"),
    ("spec as a path to /launch", "a", "POST", "launch", "{home}/runs/secret/spec.yaml", 400,
     "JSON object"),
    ("spec as YAML text to /quote", "a", "POST", "quote", "name: x\n", 400, "JSON object"),
    ("grant of nan", "teacher", "POST", "grant", {"student": "{bname}", "amount": "nan"}, 400,
     "amount"),
    ("grant of inf", "teacher", "POST", "grant", {"student": "{bname}", "amount": math.inf},
     400, "amount"),
    ("grant of a negative amount", "teacher", "POST", "grant",
     {"student": "{bname}", "amount": -5}, 400, "amount"),
    ("grant of junk", "teacher", "POST", "grant", {"student": "{bname}", "amount": "5 CNY"},
     400, "amount"),
    ("grant of more than any ledger keeps", "teacher", "POST", "grant",
     {"student": "{bname}", "amount": 1e300}, 400, "amount"),
    ("grant with an unknown field", "teacher", "POST", "grant",
     {"student": "{bname}", "amount": 5, "actor": "course-service"}, 400, "unknown field"),
    ("grant to someone not in the course", "teacher", "POST", "grant",
     {"student": "nobody-here", "amount": 5}, 400, "not a student"),
    ("a student granting themselves credit", "a", "POST", "grant",
     {"student": "{aname}", "amount": 100}, 403, "instructor"),
    ("junk max_samples", "a", "POST", "evaluate/{run}", {"max_samples": "all"}, 400,
     "max_samples"),
    ("max_samples of zero", "a", "POST", "evaluate/{run}", {"max_samples": 0}, 400,
     "max_samples"),
    ("an unknown field to evaluate", "a", "POST", "evaluate/{run}", {"limit_s": 99999}, 400,
     "unknown field"),
    ("a resume that raises its own budget", "a", "POST", "resume/{run}",
     {"changes": {"budget.limit": 1000}}, 400, "budget"),
    ("a resume with junk steps", "a", "POST", "resume/{run}",
     {"changes": {"train.max_steps": "many"}}, 400, "whole number"),
    ("unknown sweep options", "a", "POST", "sweep",
     {"spec": SMALL_RUN, "space": {"train.lr": [1e-3]}, "options": {"home": "/"}}, 400, "home"),
    ("a sweep that sets its own price", "a", "POST", "sweep",
     {"spec": SMALL_RUN, "space": {"budget.price_per_cpu_core_hour": [0.0]},
      "options": {"budget": 1}}, 400, "budget.price_per_cpu_core_hour"),
    ("a token that is no person's", "admin", "GET", "me", None, 403, "hub user"),
    ("an instructor launching on a student's credit", "teacher", "POST", "launch", {}, 403,
     "not a student"),
    ("another student's run: read", "b", "GET", "runs/{run}", None, 403, "not"),
    ("another student's run: stop", "b", "POST", "stop/{run}", None, 403, "not"),
    ("another student's run: resume", "b", "POST", "resume/{run}", {"changes": {}}, 403, "not"),
    ("another student's run: evaluate", "b", "POST", "evaluate/{run}", {}, 403, "not"),
    ("another student's run: deploy", "b", "POST", "deploy", {"runs": ["{run}"]}, 403, "not"),
    ("an endpoint name in another student's namespace", "a", "POST", "deploy",
     {"runs": ["{run}"], "name": "x.{abname}"}, 400, "no dots"),
]


@pytest.mark.parametrize("attack, key, method, route, body, code, words", HTTP_ATTACKS,
                         ids=[a[0] for a in HTTP_ATTACKS])
def test_bad_or_foreign_requests_are_refused_and_move_no_money(
        rt: dict[str, Any], a_run: str, attack: str, key: str, method: str, route: str,
        body: Any, code: int, words: str) -> None:
    names = _names(rt, a_run)
    if key == "admin":
        key = rt["admin"]
    _refused(rt, key, method, route.format(**names), _fill(body, names), code, words)


# -- links, forged files, races and a dying service: the bill is the meter's --------------------
def test_a_link_to_another_students_data_gives_nothing_of_theirs(rt: dict[str, Any]) -> None:
    """A trains on a file of A's space that links to B's data: A's processes cannot open it,
    so nothing of B's reaches A's space and nothing is charged."""
    ledger, user = _ledger(rt), rt["users"]["a"]
    known = {r["id"] for r in ledger.entries(user)}
    linked = {**SMALL_RUN, "data": {"sources": [{"path": f"{rt['spaces']['a']}/q.jsonl"}]}}
    code, answer = http("POST", rt["service"] + "launch", rt["tokens"]["a"], linked)
    assert code == 400 and "Permission denied" in answer["message"], answer
    new = [r for r in ledger.entries(user) if r["id"] not in known]
    held = {r["id"] for r in new if r["kind"] == "hold"}
    # At most a hold given back whole: nothing ran.
    assert [r["amount"] for r in new if r["kind"] == "charge" and r["hold_id"] in held] == \
        [0] * len(held), new
    _reconciled(rt)
    for path in rt["spaces"]["a"].rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET not in path.read_text(errors="replace"), path


def _processes(seen: dict[str, Any]) -> list[psutil.Process]:
    out = []
    for pid, started in seen["procs"]:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) <= 0.05:
                out.append(p)
                out += p.children(recursive=True)
        except psutil.Error:
            continue
    return out


def _environ(p: psutil.Process) -> dict[str, str] | None:
    try:
        return p.environ()
    except psutil.Error:
        return None


def test_a_run_that_lies_about_itself_pays_what_the_meter_saw(rt: dict[str, Any]) -> None:
    """A launches a CPU run with a forged budget (price 0), and while it runs forges its
    status.json (succeeded, cost 0.0001), then renames its run directory and leaves a link in
    its place to a run of the service's. The run's processes see no GPU on this GPU-priced host
    (CUDA_VISIBLE_DEVICES empty), the service shows nothing of its own file, and the charge is
    the meter's seconds at the course's price."""
    spec = {**SMALL_RUN, "name": "liar",
            "budget": {"price_per_cpu_core_hour": 0, "price_per_gpu_hour": 0, "limit": 1e6}}
    code, answer = http("POST", rt["service"] + "launch", rt["tokens"]["a"], spec)
    assert code == 201, answer
    run, hold = answer["run"], _ledger(rt).run_hold(answer["run"])
    meter = rt["state"] / "meters" / f"{hold.hold_id}.json"
    procs = wait_until("the run's processes", lambda: _processes(json.loads(meter.read_text())),
                       120, rt["log"])
    envs = [e for e in map(_environ, procs) if e is not None]
    assert envs and all(e.get("CUDA_VISIBLE_DEVICES") == "" for e in envs), envs
    run_dir = Path(hold.run_dir or "")
    forged = json.dumps({"state": "succeeded", "cost": 0.0001, "released": True})
    _as(rt, "a", f"echo '{forged}' > {run_dir}/status.json")
    view = rt["client"]["a"].run(run)
    assert view["charge"] is None and view["cost"] >= 0.01, view  # the meter's, not 0.0001
    _as(rt, "a", f"mv {run_dir} {run_dir}-moved; ln -s {rt['state']}/home/runs/secret {run_dir}")
    assert rt["client"]["a"].run(run).get("state") != SECRET
    view = wait_until("the run to settle", lambda: rt["client"]["a"].run(run)
                      if rt["client"]["a"].run(run)["charge"] is not None else None,
                      600, rt["log"])
    assert json.loads(meter.read_text())["rate"] == PRICE  # the course's, not the spec's 0
    assert view["charge"] == _bill(rt, {"id": hold.hold_id, "amount": hold.amount}) > 1
    _reconciled(rt)


def test_two_launches_racing_the_last_credit_start_one_run(rt: dict[str, Any]) -> None:
    """The race student has credit for one hold and a half; two launches sent at once: one
    starts (201), the other is refused (402) before anything is written."""
    race = rt["client"]["race"]
    hold = race.quote(SMALL_RUN)["hold"]
    need = hold + hold // 2 - race.me()["balance"]
    assert need > 0, "the race student's credit is this test's alone"
    rt["client"]["teacher"].grant(rt["users"]["race"], need / 100, note="the race")
    answers: list[tuple[int, Any]] = []
    go = threading.Barrier(2)

    def launch() -> None:
        go.wait()
        answers.append(http("POST", rt["service"] + "launch", rt["tokens"]["race"], SMALL_RUN))

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(code for code, _ in answers) == [201, 402], answers
    assert race.me()["balance"] >= 0
    _reconciled(rt)


def test_a_kill_of_the_service_mid_settle_charges_each_attempt_once(rt: dict[str, Any]) -> None:
    """B's run ends, and the service is killed (SIGKILL) the moment its last process is gone,
    before or while it settles; the hub restarts it, which settles the hold once, at the
    meter's times (an end it did not see is taken when it looks again, up to the hold)."""
    code, answer = http("POST", rt["service"] + "launch", rt["tokens"]["b"], SMALL_RUN)
    assert code == 201, answer
    hold = _ledger(rt).run_hold(answer["run"])
    meter = rt["state"] / "meters" / f"{hold.hold_id}.json"
    wait_until("B's run to start", lambda: _processes(json.loads(meter.read_text())), 120,
               rt["log"])
    wait_until("B's run to end", lambda: not _processes(json.loads(meter.read_text())), 600,
               rt["log"])
    [old] = service_pids(rt["course_json"])
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    wait_until("the hub to restart the service",
               lambda: [p for p in service_pids(rt["course_json"]) if p != old], 120, rt["log"])
    print(f"the hub started the service again {time.monotonic() - killed:.1f} s after its kill")
    _reconciled(rt)
    rows = [r for r in _ledger(rt).entries(rt["users"]["b"]) if r["hold_id"] == hold.hold_id]
    assert sorted(r["kind"] for r in rows) == ["charge", "release"]


def test_a_student_cannot_write_the_meter_or_the_ledger(rt: dict[str, Any], a_run: str) -> None:
    """A's own Unix user tries to end its run's attempt early, add an attempt of its own or
    rewrite its bill on disk."""
    meters = rt["state"] / "meters"
    meter = meters / f"{_ledger(rt).run_hold(a_run).hold_id}.json"
    wait_until("the meter of A's run", meter.exists, 120, rt["log"])
    for target in (meter, meters / "0.json", rt["state"] / "ledger.sqlite",
                   rt["state"] / "course.json"):
        done = subprocess.run(["runuser", "-u", rt["users"]["a"], "--", "bash", "-c",
                               f"echo '{{}}' > {target}"], capture_output=True, text=True)
        assert done.returncode != 0 and "Permission denied" in done.stderr, target
