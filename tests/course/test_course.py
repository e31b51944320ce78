"""A real class (tests/course/conftest.py: JupyterHub, the course service, real Unix users): two
students and an instructor, each calling the service with their own hub token or, in the browser
test, logging in through the hub's login page into their own JupyterLab.

Each test sets up what it reads, so any one runs alone or in any order: A's first run is a
module fixture; B keeps its 1 fen of credit throughout (every refusal is B's), and the
instructor's grant goes to C. The culler test stops the servers the browser test left idle
(in file order it comes last, so their minute of idleness passes while the tests between run),
or, run without it, starts an idle server of its own. The runs are real training of the
built-in tiny model on CPU, priced by the course's CPU price.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tests.course.conftest import http, service_pids, wait_until
from tests.lab.browser import shot
from tests.waiting import seen_stopped
from workbench.course.client import CourseClient
from workbench.errors import CourseError, InsufficientCreditError
from workbench.runs.ledger import Ledger
from workbench.runs.procs import ProcessIdentity

pytestmark = pytest.mark.slow
# A short run: one CPU process, a few steps. The course prices a CPU core-hour at 36 CNY, so its
# ~30-60 s cost tens of fen: measurable in a ledger kept in fen.
SMALL_RUN = {"name": "small", "train": {"max_steps": 6, "eval_every": 0},
             "resources": {"processes_per_node": 1},
             "data": {"sources": [{"max_rows": 48}], "eval_samples": 8}}


def _runs_on_disk(hub: dict[str, Any]) -> list[str]:
    """Every run in the service's home and in each student's own space."""
    folders = [hub["state"] / "home" / "runs",
               *(hub["state"] / "students").glob("*/workbench/runs")]
    return sorted(p.name for f in folders if f.exists() for p in f.iterdir())


def _run_dir(hub: dict[str, Any], key: str, run_id: str) -> Path:
    return hub["state"] / "students" / hub["users"][key] / "workbench" / "runs" / run_id


def _metered(hub: dict[str, Any], run_id: str) -> int:
    """The charge recomputed from what the service's meter observed of the run's newest attempt
    (its start and end, and the rate of its resources): whole fen, rounded up, at most the
    hold. An independent oracle for the ledger's charge."""
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    h = ledger.run_hold(run_id)
    seen = json.loads((hub["state"] / "meters" / f"{h.hold_id}.json").read_text())
    fen = seen["rate"] * (seen["end"] - seen["start"]) / 3600 * 100
    return min(h.amount, math.ceil(round(fen, 6)))


def _settled(client: CourseClient, run_id: str) -> dict[str, Any] | None:
    try:
        view = client.run(run_id)
    except CourseError:  # the service is restarting (the proxy answers 503 meanwhile)
        return None
    return view if view.get("charge") is not None else None


@pytest.fixture(scope="module")
def a_launched(hub: dict[str, Any]) -> dict[str, Any]:
    """Student A's first run, launched from A's kernel environment (only A's hub token and the
    course URL, as the hub config gives a course's servers) and settled; what A's account said
    before it and once it settled. Shared by the tests that read it, whatever their order."""
    import workbench

    a = hub["client"]["a"]
    before = a.me()["balance"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_COURSE_URL", hub["service"])
        mp.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["a"])
        job = workbench.launch(SMALL_RUN)
    view = wait_until("A's run to end and settle", lambda: _settled(a, job.id), 300, hub["log"])
    return {"job": job, "run": job.id, "view": view, "before": before, "after": a.me()}


def _log_in(page: Any, hub: dict[str, Any], key: str, path: str = "lab") -> str:
    """Log ``key`` in through the hub's login page (PAM: the Unix user's password); the hub
    starts their server and sends the browser on to ``path`` in it, once JupyterLab is up."""
    name = hub["users"][key]
    spawn = f"/hub/spawn?next={quote(f'/user/{name}/{path}', safe='')}"
    page.goto(f"{hub['base']}/hub/login?next={quote(spawn, safe='')}")
    page.fill("#username_input", name)
    page.fill("#password_input", hub["passwords"][key])
    page.click("#login_submit")
    # Through the spawn page to the server itself (not the hub's /hub/user/... pages).
    page.wait_for_url(lambda url: f"/user/{name}/lab" in url and "/hub/" not in url,
                      timeout=240_000)
    tab = page.locator(".jp-SideBar [data-id='workbench-runs']")  # the Workbench panel's tab
    try:
        tab.wait_for(timeout=120_000)
    finally:
        shot(page, f"course-lab-{key}")
    tab.click()
    return name


def test_in_the_browser_a_student_is_refused_and_the_instructor_sees_every_student(
        hub: dict[str, Any]) -> None:
    """Headless Chromium (Debian's, driven by Playwright): B logs in on the hub's login page,
    lands in JupyterLab in their own server (run as B's Unix user), and the Workbench panel shows
    B's credit; a notebook cell's workbench.launch() is refused with the service's 402 message,
    and nothing is held or started. The instructor, logged in the same way, sees every student's
    credit, spend and runs in the panel."""
    from playwright.sync_api import expect

    from tests.lab.browser import browser_page, run_first_cell

    base, admin, users = hub["base"], hub["admin"], hub["users"]
    # The instructor's server starts while B's session runs (the login then finds it up).
    assert http("POST", f"{base}/hub/api/users/{users['teacher']}/server", admin)[0] in (201, 202)
    home_b = Path(pwd.getpwnam(users["b"]).pw_dir)
    nb = new_notebook(cells=[new_code_cell(f"import workbench\nworkbench.launch({SMALL_RUN!r})")],
                      metadata={"kernelspec": {"name": "python3", "language": "python",
                                               "display_name": "Python 3 (ipykernel)"}})
    nbformat.write(nb, home_b / "refused.ipynb")
    shutil.chown(home_b / "refused.ipynb", users["b"], users["b"])
    before = _runs_on_disk(hub)
    a = hub["client"]["a"].me()
    with browser_page() as page:
        _log_in(page, hub, "b", "lab/tree/refused.ipynb")
        credit = page.locator(".jp-WorkbenchCourse-credit")
        try:
            # Generous waits throughout: a loaded 2-core machine takes tens of seconds per step.
            expect(credit).to_contain_text("Credit left 0.01 CNY", timeout=120_000)
            expect(credit).to_contain_text("held 0.00 CNY")
            # As tests/lab's browser tests: the notebook's kernel up and idle, then JupyterLab's
            # run-cell command, asked again while the cell's prompt shows it was dropped.
            page.locator(".jp-Toolbar-kernelName", has_text="Python 3").wait_for(timeout=180_000)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                timeout=180_000)
            run_first_cell(page)
            # The cell's error: the message itself, its traceback folded in the output above it.
            refused = page.locator(".jp-OutputArea-output[data-mime-type="
                                   "'application/vnd.jupyter.stderr']",
                                   has_text="InsufficientCreditError")
            refused.wait_for(timeout=180_000)
            message = refused.inner_text()
            assert message.startswith("InsufficientCreditError: "), message
            assert "0.01 CNY" in message and "nothing was started" in message, message
            assert "instructor" in message and "Traceback" not in message, message
            expect(page.locator(".jp-OutputArea-output summary",
                                has_text="full traceback")).to_be_visible()
            expect(credit).to_contain_text("held 0.00 CNY")  # the panel after the refusal
        finally:
            shot(page, "course-student-refused")

        teacher = page.context.browser.new_context(viewport={"width": 1400, "height": 900})
        tpage = teacher.new_page()
        tpage.set_default_timeout(60_000)
        _log_in(tpage, hub, "teacher")
        rows = tpage.locator(".jp-WorkbenchCourse-students tbody tr")
        expect(rows).to_have_count(3, timeout=120_000)
        shot(tpage, "course-instructor-table")
        table = {cells[0]: cells[1:] for cells in
                 (rows.nth(i).locator("td").all_inner_texts() for i in range(3))}
        spent_a = f"{a['charges'] / 100:.2f} CNY"
        launched_a = str(len([r for r in a["runs"] if r["kind"] == "launch"]))
        assert table[users["a"]] == [f"{a['balance'] / 100:.2f} CNY", "0.00 CNY", spent_a,
                                     launched_a]
        assert table[users["b"]] == ["0.01 CNY", "0.00 CNY", "0.00 CNY", "0"]
        teacher.close()
    assert _runs_on_disk(hub) == before
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    assert [e["kind"] for e in ledger.entries(users["b"])] == ["credit"]
    owners = {p.username() for p in psutil.process_iter()
              if "jupyterhub.singleuser" in " ".join(_cmdline(p))}
    assert owners == {users["b"], users["teacher"]}  # each server runs as its user, not root


def test_a_student_launches_through_workbench_launch_within_credit(
        hub: dict[str, Any], a_launched: dict[str, Any]) -> None:
    """workbench.launch() in A's kernel goes to the service, which holds, runs and charges it.
    (The kernel runs in this process: here the venv's interpreter lives under /root, which A's
    Unix user cannot execute; the on-disk isolation is checked as B's user below.)"""
    assert a_launched["before"] == 2000  # 20 CNY starting credit, in fen: A's first spending
    job, run_id, view = a_launched["job"], a_launched["run"], a_launched["view"]
    assert type(job).__name__ == "CourseJob"
    # The run is A's: in A's space, written by A's Unix user, not by the service.
    run_dir = _run_dir(hub, "a", run_id)
    assert (run_dir / "spec.yaml").stat().st_uid == pwd.getpwnam(hub["users"]["a"]).pw_uid
    # Under heavy load a run may still outlast its hold: its budget stop then ends it, and the
    # charge stays within the hold either way.
    assert view["state"] in ("succeeded", "budget_stopped"), view
    status = json.loads((run_dir / "status.json").read_text())
    assert 0 < view["charge"] <= view["hold"] <= 2000
    # Billed from what the service saw, not from the file A's run wrote: from the launch's
    # hand-over (after the data was prepared) to the last process's end, so never more than
    # the run's own bill, which starts before the data step.
    assert view["charge"] == _metered(hub, run_id)
    assert view["charge"] <= status["cost"] * 100 + 1
    me = a_launched["after"]
    assert me["held"] == 0 and me["balance"] == 2000 - view["charge"]


def test_a_students_evaluate_resume_and_deploy_go_through_the_service(
        hub: dict[str, Any], a_launched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """In A's kernel environment: job.evaluate() is held and charged by the second it ran,
    job.resume() is held and charged only what it added, workbench.deploy() is refused before
    anything starts (an endpoint's first hour costs more than any credit)."""
    import workbench

    a, job, run_id = hub["client"]["a"], a_launched["job"], a_launched["run"]
    monkeypatch.setenv("WORKBENCH_COURSE_URL", hub["service"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["a"])
    run_dir = _run_dir(hub, "a", run_id)
    balance = a.me()["balance"]
    started = time.time()
    report = job.evaluate("heldout", max_samples=4)
    took = time.time() - started
    assert "heldout" in report["table"]
    # 36 CNY a core-hour is 1 fen a second: the charge is at most the seconds the call took.
    assert 0 < report["charge"] <= min(report["hold"], took + 1)
    # A CPU run is scored on one core of the hub machine; the reply says at what rate.
    assert report["rate_text"] == "36.00 CNY an hour (one CPU core on local)"
    manual = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()
              if json.loads(line).get("phase") == "manual"]
    assert manual and manual[-1]["task"] == "heldout"
    me = a.me()
    assert me["held"] == 0 and me["balance"] == balance - report["charge"]

    job.resume(**{"train.max_steps": 9})
    assert a.run(run_id)["kind"] == "resume" and a.me()["held"] > 0
    view = wait_until("A's resumed run to settle", lambda: _settled(a, run_id), 300, hub["log"])
    after = json.loads((run_dir / "status.json").read_text())
    assert view["state"] in ("succeeded", "budget_stopped"), view
    if view["state"] == "succeeded":
        assert after["step"] == 9
    # The resume's own attempt, as the meter saw it, not the whole run's.
    assert view["charge"] == _metered(hub, run_id) and view["charge"] <= view["hold"]
    assert a.me()["balance"] == me["balance"] - view["charge"]

    with pytest.raises(InsufficientCreditError, match="1000.00 CNY.*nothing was started"):
        workbench.deploy(job)
    assert not (hub["state"] / "home" / "endpoints").exists() or not any(
        (hub["state"] / "home" / "endpoints").iterdir())
    assert a.endpoints() == []
    assert a.me()["balance"] == me["balance"] - view["charge"]  # neither held nor charged


def test_a_students_endpoint_runs_as_them_and_bills_the_seconds_the_service_saw(
        hub: dict[str, Any], a_launched: dict[str, Any]) -> None:
    """Granted enough for an endpoint's first block, A deploys the run: its guard and vLLM run as
    A's Unix user on A's own files (nothing of the service's), only A's key reaches it, A's
    forged files saying it ended do not stop the bill, and the undeploy ends every process and
    charges the seconds it was up."""
    a, teacher, run_id = hub["client"]["a"], hub["client"]["teacher"], a_launched["run"]
    uid = pwd.getpwnam(hub["users"]["a"]).pw_uid
    teacher.grant(hub["users"]["a"], 1001, note="an endpoint's first hour")
    before = a.me()
    started = time.time()
    ep = a.deploy([run_id], name="home")
    assert ep.name == f"home.{hub['users']['a']}" and ep.view["state"] == "healthy"
    assert a.me()["held"] == before["held"] + 100_000  # one block: 1000 CNY, in fen
    servers = [p for p in psutil.process_iter(["cmdline", "uids"])
               if "--lora-modules" in (p.info["cmdline"] or []) and ep.name in " ".join(
                   p.info["cmdline"] or [])]
    assert servers, "no vLLM process serves the endpoint"
    assert {p.info["uids"].real for p in servers} == {uid}  # vLLM runs as A
    cmdline = " ".join(servers[0].info["cmdline"])
    assert str(_run_dir(hub, "a", run_id)) in cmdline  # A's own adapter, read as A
    assert str(hub["state"]) + "/home" not in cmdline and "/serving/" not in cmdline
    assert ep.chat("Say hi", max_tokens=4)  # with A's key, from A's view
    keyless = urllib.request.Request(f"{ep.url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyless, timeout=30)
    assert refused.value.code == 401
    # A writes, in A's own endpoint folder, that the server ended long ago and names no process:
    # the service meters what it saw start, not those files.
    folder = hub["state"] / "students" / hub["users"]["a"] / "workbench" / "endpoints" / ep.name
    for file, body in (("processes.json", "[]"), ("exit.json", json.dumps({"time": started}))):
        (folder / file).write_text(body)
        os.chown(folder / file, uid, -1)
    forged = time.time()
    record = hub["state"] / "served" / f"{ep.name}.json"  # the service's own, written each look
    wait_until("the service's next look at the endpoint",
               lambda: record.stat().st_mtime > forged + 0.01, 60, hub["log"])
    assert a.endpoints()[0]["state"] == "healthy" and a.me()["held"] >= 100_000
    view = a.undeploy(ep.name)
    up = time.time() - started
    assert view["held"] == 0 and view["state"] == "stopped"
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # 1000 CNY an hour is 100000 fen in 3600 s: about 27.8 fen a second it was up.
    assert 0 < view["charged"] <= math.ceil(up * 100_000 / 3600) + 1, (view, up)
    assert view["charged"] >= math.floor((forged - started) * 100_000 / 3600)  # not the forgery's
    assert a.me()["balance"] == before["balance"] - view["charged"]


def test_a_students_export_runs_as_them_into_their_run_and_is_charged_the_seconds(
        hub: dict[str, Any], a_launched: dict[str, Any]) -> None:
    """job.export() in A's kernel: the service exports as A (the files are A's, in A's run
    folder), holds eval_minutes at the run's rate and charges the seconds it took; a bad format
    is a 400 that moves no money."""
    a, job, run_id = hub["client"]["a"], a_launched["job"], a_launched["run"]
    before = a.me()
    bad = http("POST", f"{hub['service']}export/{run_id}", hub["tokens"]["a"],
               {"formats": ["zip"]})
    assert bad[0] == 400 and a.me() == before
    started = time.time()
    report = job.export(["merged"])
    took = time.time() - started
    merged = Path(report["folders"]["merged"])
    assert merged == _run_dir(hub, "a", run_id) / "export" / "merged"
    assert (merged / "config.json").stat().st_uid == pwd.getpwnam(hub["users"]["a"]).pw_uid
    assert "identical" in json.dumps(report["checks"])  # checked by running it, as A
    # 36 CNY a core-hour is 1 fen a second: at most the seconds the call took.
    assert 0 < report["charge"] <= min(report["hold"], took + 1)
    after = a.me()
    assert after["held"] == before["held"] and after["balance"] == before["balance"] - report["charge"]


def _sweeps_on_disk(hub: dict[str, Any]) -> list[str]:
    """Every sweep in the service's home and in each student's own space."""
    folders = [hub["state"] / "home" / "sweeps",
               *(hub["state"] / "students").glob("*/workbench/sweeps")]
    return sorted(p.name for f in folders if f.exists() for p in f.iterdir())


def test_a_run_or_sweep_over_credit_is_refused_before_it_starts(
        hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench

    b = hub["client"]["b"]
    before = _runs_on_disk(hub)
    with pytest.raises(InsufficientCreditError) as err:
        b.launch(SMALL_RUN)
    message = str(err.value)
    assert "0.01 CNY" in message and "nothing was started" in message and "instructor" in message
    # B's kernel: workbench.sweep() asks the service to hold the whole sweep, which B's credit
    # cannot take: refused before any trial or sweep directory exists.
    monkeypatch.setenv("WORKBENCH_COURSE_URL", hub["service"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["b"])
    sweeps_before = _sweeps_on_disk(hub)
    with pytest.raises(InsufficientCreditError) as refused:
        workbench.sweep(SMALL_RUN, space={"train.lr": [1e-3, 2e-3]})
    assert "0.01 CNY" in str(refused.value) and "nothing was started" in str(refused.value)
    assert _runs_on_disk(hub) == before and _sweeps_on_disk(hub) == sweeps_before
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    assert [e["kind"] for e in ledger.entries(hub["users"]["b"])] == ["credit"]


def _running_trial(record: Path) -> dict[str, Any] | None:
    """The record once every trial has been launched and one still runs: the controller is then
    only watching (killed earlier, a trial's launch would wait for the new controller)."""
    data = json.loads(record.read_text())
    launched = len(data["trials"]) == data["trials_total"] and all(
        t.get("run_id") for t in data["trials"])
    live = [t for t in data["trials"] if not t.get("released")]
    return data if launched and live and data.get("controller") else None


def _resumed(record: Path, old_pid: int) -> dict[str, Any] | None:
    data = json.loads(record.read_text())
    ident = data.get("controller") or {}
    return data if ident.get("pid") not in (None, old_pid) else None


def test_a_students_sweep_runs_as_them_held_whole_and_charged_per_trial(
        hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A's kernel: workbench.sweep() over two learning rates runs through the service, as A: the
    sweep and its trials' runs are A's files in A's space, their processes A's; one hold for the
    sweep, one charge per trial (what the service's meter saw of its supervisor, at least the
    run's own bill), the rest of the hold released at the end; B cannot see it, the instructor
    can. Its controller is killed (SIGKILL) while a trial runs: the service resumes the sweep as
    A, and no trial is charged twice."""
    import workbench

    a, user_a = hub["client"]["a"], hub["users"]["a"]
    uid_a = pwd.getpwnam(user_a).pw_uid
    monkeypatch.setenv("WORKBENCH_COURSE_URL", hub["service"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub["tokens"]["a"])
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    rows_before = len(ledger.entries(user_a))
    balance = a.me()["balance"]
    spec = {**SMALL_RUN, "name": "lr-sweep", "train": {"max_steps": 2, "eval_every": 0}}
    s = workbench.sweep(spec, space={"train.lr": [1e-3, 2e-3]}, concurrent=2)
    assert type(s).__name__ == "CourseSweep"
    hold = s.started["hold"]
    assert 0 < hold <= balance and a.me()["held"] == hold
    assert http("GET", f"{hub['service']}sweeps/{s.id}", hub["tokens"]["b"])[0] == 403
    assert hub["client"]["b"].sweeps() == []
    assert s.id in [x["sweep"] for x in hub["client"]["teacher"].sweeps()]
    record = hub["state"] / "students" / user_a / "workbench" / "sweeps" / s.id / "sweep.json"
    assert record.stat().st_uid == uid_a
    assert not (hub["state"] / "home" / "sweeps" / s.id).exists()

    def running_trial_seen_stopped() -> dict[str, Any] | None:
        # Read with the controller stopped (SIGSTOP), and killed in that state: it cannot
        # release the running trial, or end the sweep, between the read and the kill.
        ident = json.loads(record.read_text()).get("controller")
        return seen_stopped(ProcessIdentity.from_dict(ident), lambda: _running_trial(record)) \
            if ident else None

    first = wait_until("A's trials to start", running_trial_seen_stopped, 240, hub["log"])
    old = ProcessIdentity.from_dict(first["controller"])
    assert psutil.Process(old.pid).uids().real == uid_a  # the controller is A's process
    assert old.signal(signal.SIGKILL), "the recorded controller is not running"
    wait_until("the killed controller to be gone", lambda: not old.alive(), 60, hub["log"])
    resumed = wait_until("the service to resume A's sweep", lambda: _resumed(record, old.pid),
                         180, hub["log"])
    assert resumed["budget"] == first["budget"]
    new = ProcessIdentity.from_dict(resumed["controller"])
    wait_until("A's sweep to end and settle", lambda: s.status()["settled"], 300, hub["log"])
    view = s.status()
    assert view["state"] == "succeeded", view
    [meter] = [json.loads(p.read_text()) for p in (hub["state"] / "sweep-meters").glob("*.json")
               if json.loads(p.read_text())["sweep"] == s.id]
    assert meter["resumes"] == 1 and [r[0] for r in meter["roots"]] == [old.pid, new.pid]
    trials = view["trials"]
    assert sorted(t["params"]["train.lr"] for t in trials) == [1e-3, 2e-3]
    seen = {t["run"]: t for t in meter["trials"].values()}
    for t in trials:
        run_dir = _run_dir(hub, "a", t["run_id"])
        status = json.loads((run_dir / "status.json").read_text())
        assert status["sweep"]["id"] == s.id and status["state"] == "succeeded"
        assert (run_dir / "status.json").stat().st_uid == uid_a
        # The meter's own times (the supervisor's start, the tick that saw it gone) at 1 fen a
        # second, rounded up: at least the run's own bill, at most a few ticks more.
        m = seen[t["run_id"]]
        assert meter["rate"] == 36  # one process at the course's 36 CNY a core-hour
        assert t["charge"] == math.ceil(round((m["end"] - m["start"]) * 36 / 3600 * 100, 6))
        assert status["cost"] * 100 <= t["charge"] <= status["cost"] * 100 + 10, (t, status)
    rows = ledger.entries(user_a)[rows_before:]
    assert [r["kind"] for r in rows] == ["hold", "charge", "charge", "charge", "release"], rows
    assert rows[0]["amount"] == rows[-1]["amount"] == hold
    charged = sum(t["charge"] for t in trials)
    # The trials' charges in the order they ended, then the hold's own (nothing more) and the
    # release of the whole hold.
    assert sorted(r["amount"] for r in rows[1:3]) == sorted(t["charge"] for t in trials)
    assert rows[3]["amount"] == 0
    assert view["charged"] == charged <= hold
    me = a.me()
    assert me["held"] == 0 and me["balance"] == balance - charged


def test_a_student_cannot_see_others_runs_or_raise_their_credit(
        hub: dict[str, Any], a_launched: dict[str, Any]) -> None:
    b, token_b, service = hub["client"]["b"], hub["tokens"]["b"], hub["service"]
    hub = {**hub, "a_run": a_launched["run"]}
    assert hub["a_run"] not in [r["run"] for r in b.runs()]
    assert http("GET", f"{service}runs/{hub['a_run']}", token_b)[0] == 403
    assert http("POST", f"{service}stop/{hub['a_run']}", token_b)[0] == 403
    assert http("POST", f"{service}grant", token_b,
                 {"student": hub["users"]["b"], "amount": 100})[0] == 403
    assert http("GET", f"{service}export.csv", token_b)[0] == 403
    assert http("GET", f"{service}me", "not-a-token")[0] == 403
    for action, body in ((f"evaluate/{hub['a_run']}", {}), (f"resume/{hub['a_run']}", {}),
                         ("deploy", {"runs": [hub["a_run"]]}), ("students", None)):
        code, answer = http("POST" if body is not None else "GET", service + action, token_b,
                             body)
        assert code == 403, (action, answer)
    assert b.me()["balance"] == 1
    # On disk: B's own Unix user can list the parent but not the ledger, prices or A's run.
    user_b = hub["users"]["b"]
    ls = subprocess.run(["runuser", "-u", user_b, "--", "ls", str(hub["root"])],
                        capture_output=True, text=True)
    assert ls.returncode == 0 and "state" in ls.stdout
    for path in (hub["state"] / "ledger.sqlite", hub["state"] / "course.json",
                 _run_dir(hub, "a", hub["a_run"]) / "status.json"):
        read = subprocess.run(["runuser", "-u", user_b, "--", "cat", str(path)],
                              capture_output=True, text=True)
        assert read.returncode != 0 and "Permission denied" in read.stderr, path


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_instructor_grant_lets_the_launch_run_across_a_service_kill(
        hub: dict[str, Any], a_launched: dict[str, Any]) -> None:
    from workbench_lab.course import course_grant, course_panel

    teacher, c = hub["client"]["teacher"], hub["client"]["c"]
    user_c = hub["users"]["c"]
    # The planner learns from ended runs (A's), so ask the course what C's run will hold.
    need = c.quote(SMALL_RUN)["hold"]
    assert need > c.me()["balance"] == 1
    grant = (need // 100) + 1  # whole CNY, enough for the hold
    # The instructor's panel: every student's account, and its grant form.
    table = {row["student"]: row for row in course_panel(teacher)["students"]}
    assert table[user_c]["balance"] == 0.01 and table[hub["users"]["a"]]["runs"] == 1
    panel = course_grant({"student": user_c, "amount": grant, "note": "lab 2"}, teacher)
    assert {row["student"]: row for row in panel["students"]}[user_c]["balance"] == \
        pytest.approx(0.01 + grant)
    assert c.me()["balance"] == 1 + grant * 100
    job = c.launch(SMALL_RUN)
    assert job.id in [r["run"] for r in teacher.runs()]  # the instructor sees every run
    wait_until("C's run to start", lambda: job.state in ("running", "succeeded"), 240, hub["log"])
    ledger = Ledger(f"sqlite:///{hub['state'] / 'ledger.sqlite'}")
    rows_before = ledger.entries()
    assert job.id in [h.run_id for h in ledger.holds(open_only=True)]  # killed before settling
    [old_pid] = service_pids(hub["course_json"])
    os.kill(old_pid, signal.SIGKILL)
    # The run is detached from the service; the hub starts the service again (it polls it).
    wait_until("the hub to restart the service",
              lambda: [p for p in service_pids(hub["course_json"]) if p != old_pid], 120,
              hub["log"])
    wait_until("the restarted service to answer",
              lambda: http("GET", hub["service"] + "me", hub["tokens"]["c"])[0] == 200, 120,
              hub["log"])
    view = wait_until("C's run to settle after the restart", lambda: _settled(c, job.id), 300,
                     hub["log"])
    rows_after = ledger.entries()
    assert rows_after[:len(rows_before)] == rows_before
    assert view["state"] in ("succeeded", "budget_stopped") and 0 < view["charge"] <= view["hold"]
    assert c.me()["balance"] == 1 + grant * 100 - view["charge"]
    csv = teacher.export_csv().splitlines()
    spend = {line.split(",")[0]: line.split(",") for line in csv[1:]}
    assert float(spend[user_c][3]) * 100 == pytest.approx(view["charge"])
    assert float(spend[user_c][2]) == grant


def test_a_student_is_refused_force_and_a_course_error_is_typed(hub: dict[str, Any]) -> None:
    from workbench.course.client import launch_via_course

    with pytest.raises(CourseError, match="force=True"):
        launch_via_course(SMALL_RUN, force=True)
    with pytest.raises(CourseError, match="allows 1 per run|processes"):
        hub["client"]["a"].launch({**SMALL_RUN, "resources": {"processes_per_node": 2}})


@pytest.mark.parametrize("route, body, words", [
    ("grant", {"student": "X", "amount": "nan"}, "positive number"),
    ("grant", {"student": "X", "amount": float("inf")}, "positive number"),
    ("grant", {"student": "X", "amount": -5}, "positive number"),
    ("grant", {"student": "X", "amount": True}, "positive number"),
    ("grant", {"student": "X", "amount": 5, "sneaky": 1}, "unknown field"),
    ("evaluate/RUN", {"max_samples": "junk"}, "whole number"),
    ("evaluate/RUN", {"max_samples": 0}, "whole number"),
    ("resume/RUN", {"changes": {"train.max_steps": "many"}}, "whole number"),
    ("sweep", {"spec": "/srv/other/spec.yaml", "space": {"train.lr": [1e-3]}}, "mapping"),
    ("launch", "/srv/other/spec.yaml", "JSON object"),
    ("launch", {"model": {"trust_remote_code": True}}, "model.trust_remote_code"),
    ("launch", {"serve": {"python": "/tmp/x"}}, "serve.python"),
    ("quote", {"train": {"learning_rate": 1}}, "learning_rate"),
])
def test_bad_input_to_the_service_is_a_400_that_says_what_to_send(
        hub: dict[str, Any], a_launched: dict[str, Any], route: str, body: Any,
        words: str) -> None:
    """Nothing a student sends ends in a 500 or a traceback, and none of it moves money."""
    hub = {**hub, "a_run": a_launched["run"]}
    key = "teacher" if route == "grant" else "a"
    body = {**body, "student": hub["users"]["b"]} if route == "grant" else body
    before = hub["client"]["b"].me()["balance"], hub["client"]["a"].me()["balance"]
    code, answer = http("POST", hub["service"] + route.replace("RUN", hub["a_run"]),
                        hub["tokens"][key], body)
    assert code == 400 and words in answer["message"], (code, answer)
    assert "Traceback" not in json.dumps(answer)
    assert (hub["client"]["b"].me()["balance"], hub["client"]["a"].me()["balance"]) == before


def test_someone_not_in_the_course_gets_a_403_not_a_500(hub: dict[str, Any]) -> None:
    code, answer = http("POST", hub["service"] + "grant", hub["tokens"]["teacher"],
                        {"student": "nobody-here", "amount": 5})
    assert code == 400 and "not a student" in answer["message"], answer
    code, answer = http("POST", hub["service"] + "launch", hub["tokens"]["teacher"], {})
    assert code == 403 and "not a student" in answer["message"], answer


def test_the_idle_culler_stops_the_servers_left_idle(hub: dict[str, Any]) -> None:
    """jupyterhub-idle-culler, configured by `workbench course init` (idle_minutes: 1), stops
    B's and the instructor's servers, idle since the browser test closed its pages; run without
    that test, it stops an instructor's server started here and never used."""
    base, admin = hub["base"], hub["admin"]
    services = http("GET", f"{base}/hub/api/services", admin)[1]
    assert "idle-culler" in services
    names = [hub["users"][k] for k in ("b", "teacher")]

    def servers(name: str) -> dict[str, Any]:
        return dict(http("GET", f"{base}/hub/api/users/{name}", admin)[1]["servers"])

    if "Culling server" not in hub["log"].read_text(errors="replace") and not any(
            servers(n) for n in names):
        teacher = hub["users"]["teacher"]
        assert http("POST", f"{base}/hub/api/users/{teacher}/server", admin)[0] in (201, 202)
        wait_until(f"{teacher}'s server to be ready",
                   lambda: servers(teacher).get("", {}).get("ready"), 240, hub["log"])
    for name in names:
        wait_until(f"the culler to stop {name}'s idle server",
                   lambda u=name: servers(u) == {}, 240, hub["log"])
    assert "Culling server" in hub["log"].read_text(errors="replace")
