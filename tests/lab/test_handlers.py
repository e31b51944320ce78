"""The panel's REST endpoints against a real Jupyter server and real runs: Jupyter's own token
and XSRF protection apply, malformed ids and traversal are refused, and list / details / logs /
cancel return what the workbench library says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import yaml

import workbench
from workbench.targets.named import target_names

from .conftest import LabServer, wait_for


@pytest.fixture(scope="module")
def short_run(lab_server: LabServer, finished_job: workbench.Job) -> workbench.Job:
    # The suite's shared finished run (tests/conftest.py), snapshotted every 10 steps.
    return finished_job


@pytest.fixture
def cookie_session(lab_server: LabServer) -> requests.Session:
    """A browser-like session: logged in by cookie (token only in the first URL), as the lab UI is."""
    session = requests.Session()
    session.get(f"{lab_server.url}/lab?token={lab_server.token}", timeout=30).raise_for_status()
    assert "_xsrf" in session.cookies
    return session


def test_requests_without_a_token_are_refused(lab_server: LabServer) -> None:
    assert requests.get(lab_server.api("runs"), timeout=10).status_code == 403
    assert requests.post(lab_server.api("runs/any-run/cancel"), timeout=10).status_code == 403
    assert requests.get(lab_server.api("runs"), headers={"Authorization": "token wrong"},
                        timeout=10).status_code == 403


def test_a_cookie_post_without_the_xsrf_token_is_refused(lab_server: LabServer,
                                                          cookie_session: requests.Session) -> None:
    assert cookie_session.get(lab_server.api("runs"), timeout=30).status_code == 200
    url = lab_server.api("notebooks")
    refused = cookie_session.post(url, json={"directory": ""}, timeout=30)
    assert refused.status_code == 403 and "xsrf" in refused.text.lower()
    accepted = cookie_session.post(url, json={"directory": ""}, timeout=30,
                                   headers={"X-XSRFToken": cookie_session.cookies["_xsrf"]})
    assert accepted.status_code == 201, accepted.text
    assert (lab_server.root / accepted.json()["path"]).is_file()


@pytest.mark.parametrize("path", [
    "runs/..%2F..%2Fregistry.sqlite",
    "runs/%2Fetc%2Fpasswd",
    "runs/..",
    "runs/.hidden",
    "runs/no-such-run",
    "runs/no-such-run/logs",
])
def test_malformed_or_unknown_run_ids_are_refused(lab_server: LabServer, path: str) -> None:
    reply = requests.get(lab_server.api(path), headers=lab_server.auth, timeout=10)
    assert reply.status_code in (400, 404), reply.text
    assert "root:" not in reply.text and "SQLite" not in reply.text


@pytest.mark.parametrize("name", ["../status.json", "..%2F..%2Fregistry.sqlite", "/etc/passwd",
                                  "rank-9.log", ".."])
def test_log_names_cannot_leave_the_runs_log_folder(lab_server: LabServer, short_run, name) -> None:
    url = lab_server.api(f"runs/{short_run.id}/logs") + f"?name={name}"
    reply = requests.get(url, headers=lab_server.auth, timeout=10)
    assert reply.status_code == 400, reply.text
    assert '"state"' not in reply.text and "root:" not in reply.text


def test_new_notebooks_stay_inside_the_server_root(lab_server: LabServer) -> None:
    for directory in ("../..", "/etc", "runs/../../.."):
        reply = requests.post(lab_server.api("notebooks"), json={"directory": directory},
                              headers=lab_server.auth, timeout=10)
        assert reply.status_code in (400, 404), (directory, reply.text)


def test_list_and_details_of_a_finished_run(lab_server: LabServer, short_run) -> None:
    reply = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=30)
    assert reply.status_code == 200
    body = reply.json()
    assert body["capabilities"]["cancel"] is True
    # Capabilities follow the installed library: a button shows only where a call backs it.
    assert body["capabilities"]["resume"] == callable(getattr(workbench.Job, "resume", None))
    assert body["capabilities"]["deploy"] == callable(getattr(workbench.Job, "deploy", None))
    assert set(body["capabilities"]) >= {"resume", "deploy", "snapshots", "endpoints", "tensorboard"}
    # Where Deploy may serve: the same list a run form offers, local first.
    assert body["targets"] == target_names() and body["targets"][0] == "local"
    row = next(r for r in body["runs"] if r["id"] == short_run.id)
    summary = short_run.summary()  # the same library call the server makes
    for key in ("state", "target", "step", "total_steps", "first_loss", "last_loss"):
        assert row[key] == summary[key], key
    last = short_run.spec.train.max_steps
    assert row["state"] == "succeeded" and row["step"] == row["total_steps"] == last
    assert len(row["curve"]) >= 10 and all(len(p) == 2 for p in row["curve"])
    assert row["browse_path"] == f"runs/{short_run.id}"

    details = requests.get(lab_server.api(f"runs/{short_run.id}"), headers=lab_server.auth,
                           timeout=30).json()
    assert [m["step"] for m in details["metrics"] if "loss" in m] == \
        [m["step"] for m in short_run.metrics() if "loss" in m]
    assert "rank-0.log" in details["log_names"] and "==> " in details["logs"]
    assert body["capabilities"]["snapshots"]
    snaps = details["snapshots"]
    assert [s["name"] for s in snaps][:1] == [f"step-{last}"] and all(s["complete"] for s in snaps)
    assert snaps[0]["browse_path"] == f"runs/{short_run.id}/checkpoints/step-{last}"
    # Its newest score of each metric (read back from eval.jsonl here), and its settings.
    lines = [json.loads(x) for x in
             (short_run.run_dir.path / "eval.jsonl").read_text().splitlines() if x]
    newest = [x for x in lines if x["task"] == "heldout" and x["model"] == "run"][-1]
    shown = {(s["task"], s["metric"]): s["value"] for s in details["scores"]}
    assert shown == {("heldout", k): v for k, v in newest["metrics"].items()}
    assert ["learning rate", "0.003"] in details["settings"]
    assert ["length", f"{last} steps"] in details["settings"]
    assert yaml.safe_load(details["spec_yaml"])["train"]["lr"] == 0.003

    logs = requests.get(lab_server.api(f"runs/{short_run.id}/logs") + "?name=rank-0.log&tail=5",
                        headers=lab_server.auth, timeout=30).json()
    assert logs["text"] == short_run.logs(tail=5, name="rank-0.log")


def test_deploy_from_the_api_returns_at_once_and_the_endpoint_serves(lab_server: LabServer,
                                                                      short_run) -> None:
    import time

    from workbench.serve import get_endpoint

    t0 = time.time()
    reply = requests.post(lab_server.api(f"runs/{short_run.id}/deploy"), headers=lab_server.auth,
                          json={"target": "local"}, timeout=120)  # as the panel's dialog sends it
    assert reply.status_code == 200, reply.text
    row = reply.json()["endpoint"]
    # The request does not wait for vLLM (tens of seconds); the panel shows it starting.
    assert time.time() - t0 < 30 and row["state"] == "starting" and row["target"] == "local"
    name = row["name"]
    try:
        def healthy() -> bool:
            listed = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=30)
            states = {e["name"]: e["state"] for e in listed.json().get("endpoints", [])}
            assert states.get(name) != "failed", get_endpoint(name).logs()
            return states.get(name) == "healthy"

        wait_for(healthy, 300, "the endpoint deployed from the panel to become healthy")
        endpoint = get_endpoint(name)
        # The server itself lists the run's adapter and generates with it: greedy tokens (an
        # early EOS still counts one), ended by a stop or by the limit.
        assert endpoint.model in endpoint.list_models()
        answer = endpoint.client().chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": "What does a cow say?"}],
            temperature=0.0, max_tokens=8)
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 8
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.choices[0].message.content == endpoint.chat("What does a cow say?",
                                                                  max_tokens=8)
    finally:
        stopped = requests.post(lab_server.api(f"endpoints/{name}/stop"), headers=lab_server.auth,
                                timeout=120)
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped"
    assert get_endpoint(name).record.state == "stopped"


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"target": "nowhere"}, 409, "nowhere"),  # not in targets.yaml: the library's own error
    ({"target": "../etc"}, 400, "is not a target name"),
    ([1, 2], 400, "the body must be"),
])
def test_deploy_to_a_bad_target_is_refused_before_anything_starts(lab_server: LabServer, short_run,
                                                                   body, status, says) -> None:
    before = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=30).json()
    reply = requests.post(lab_server.api(f"runs/{short_run.id}/deploy"), headers=lab_server.auth,
                          json=body, timeout=60)
    assert reply.status_code == status and says in reply.reason, (reply.status_code, reply.reason)
    after = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=30).json()
    assert after["endpoints"] == before["endpoints"]  # no endpoint was even recorded


def test_cancel_and_resume_from_the_api_stop_and_restart_a_live_run(lab_server: LabServer) -> None:
    # One long run for both buttons: each real run costs the suite ~30 s.
    job = workbench.launch({"name": "lab-resume", "train": {"max_steps": 100000}})
    try:
        wait_for(lambda: job.state == "running", 180, "the long run to start")
        reply = requests.post(lab_server.api(f"runs/{job.id}/cancel"), headers=lab_server.auth,
                              timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["state"] == "cancelled"
        assert job.state == "cancelled"
        # Cancelling an ended run is harmless and says how it ended.
        again = requests.post(lab_server.api(f"runs/{job.id}/cancel"), headers=lab_server.auth,
                              timeout=60)
        assert again.json()["state"] == "cancelled"
        caps = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=30).json()
        assert caps["capabilities"]["resume"] is True
        reply = requests.post(lab_server.api(f"runs/{job.id}/resume"), headers=lab_server.auth,
                              timeout=60)
        assert reply.status_code in (200, 201), reply.text
        wait_for(lambda: job.state == "running", 180, "the resumed run to start")
    finally:
        job.cancel()
    assert job.state == "cancelled"


def test_settings_are_in_the_settings_editor(lab_server: LabServer) -> None:
    reply = requests.get(f"{lab_server.url}/lab/api/settings/workbench-lab:plugin",
                         headers=lab_server.auth, timeout=30)
    assert reply.status_code == 200
    props = reply.json()["schema"]["properties"]
    assert props["refreshInterval"]["default"] == 2 and props["defaultTarget"]["default"] == "local"


def test_tensorboard_opens_for_a_run_with_events(lab_server: LabServer, short_run,
                                                 cookie_session: requests.Session) -> None:
    assert list(short_run.run_dir.tb_dir.rglob("events.out.tfevents.*"))  # tracking default
    reply = requests.post(lab_server.api(f"runs/{short_run.id}/tensorboard"),
                          headers=lab_server.auth, timeout=60)
    assert reply.status_code == 200, reply.text
    url = reply.json()["url"]
    # Served through Jupyter (a path on its own server), so it works wherever Jupyter is reached.
    assert url == f"/workbench/tensorboard/{short_run.id}/"
    page = requests.get(lab_server.url + url, headers=lab_server.auth, timeout=30)
    assert page.status_code == 200 and "<title>TensorBoard</title>" in page.text, page.text[:300]
    tags = requests.get(lab_server.url + url + "data/plugin/scalars/tags", headers=lab_server.auth,
                        timeout=30).json()
    run = next(r for r, t in tags.items() if "train/loss" in t)
    # The page's own scalar query is a POST with TensorBoard's header and no Jupyter XSRF token.
    series = requests.post(lab_server.url + url + "data/plugin/scalars/scalars_multirun",
                           data={"tag": "train/loss", "runs": run}, timeout=30,
                           headers={**lab_server.auth, "X-XSRF-Protected": "1"})
    assert series.status_code == 200, series.text[:300]
    losses = {m["step"]: m["loss"] for m in short_run.metrics() if "loss" in m}
    points = series.json()[run]  # [wall time, step, value]
    assert sorted(p[1] for p in points) == sorted(losses)  # every logged step, each once
    assert all(p[2] == pytest.approx(losses[p[1]], rel=1e-5) for p in points)
    # A browser tab opened from the panel carries Jupyter's login cookie, not a token.
    assert cookie_session.get(lab_server.url + url, timeout=30).status_code == 200
    # Jupyter's authentication still applies.
    anonymous = requests.get(lab_server.url + url + "data/plugin/scalars/tags", timeout=30,
                             allow_redirects=False)
    assert anonymous.status_code == 302, anonymous.status_code  # to Jupyter's login page
    assert "/login" in anonymous.headers["Location"]
    assert "tags" not in anonymous.text
    # Asking again reuses the same TensorBoard.
    again = requests.post(lab_server.api(f"runs/{short_run.id}/tensorboard"),
                          headers=lab_server.auth, timeout=60)
    assert again.json()["url"] == url


def test_tensorboard_of_a_run_not_opened_is_a_clear_404(lab_server: LabServer, short_run) -> None:
    reply = requests.get(f"{lab_server.url}/workbench/tensorboard/no-such-run/", timeout=30,
                         headers=lab_server.auth)
    assert reply.status_code == 404 and "open it from the Runs panel" in reply.reason


@pytest.mark.parametrize(("body", "says"), [
    ({"budget_limit": "lots"}, "budget_limit must be a positive number"),
    ({"budget_limit": -5}, "budget_limit must be a positive number"),
    ({"budget_limit": True}, "budget_limit must be a positive number"),
    ({"budget": 50}, 'the body must be {"budget_limit": ...}'),
])
def test_resume_with_a_bad_budget_is_refused_before_anything_starts(lab_server: LabServer,
                                                                    short_run, body, says) -> None:
    before = short_run.status()
    reply = requests.post(lab_server.api(f"runs/{short_run.id}/resume"), headers=lab_server.auth,
                          json=body, timeout=60)
    assert reply.status_code == 400 and says in reply.reason, (reply.status_code, reply.reason)
    assert short_run.status() == before  # not queued again
    assert not short_run.run_dir.resume_file.exists()  # and nothing recorded for a resume


def test_compare_notebook_for_selected_runs(lab_server: LabServer, tmp_path) -> None:
    """The panel's Compare: a notebook whose first code cell compares exactly the ticked runs."""
    import json as _json
    import time as _time

    from workbench.runs.registry import Registry, RunRecord
    from workbench.runs.rundir import RunDir
    from workbench.spec import RunSpec

    ids = ["cmp-nb-a", "cmp-nb-b"]
    for run_id in ids:
        rd = RunDir(tmp_path / run_id).create(RunSpec(name=run_id))
        now = _time.time()
        Registry().add_run(RunRecord(id=run_id, name=run_id, target="local", backend_job_id=None,
                                     run_dir=str(rd.path), state="pending", created=now,
                                     updated=now))
    try:
        url = lab_server.api("notebooks")
        reply = requests.post(url, json={"directory": "", "runs": ids}, headers=lab_server.auth,
                              timeout=30)
        assert reply.status_code == 201, reply.text
        nb = _json.loads((lab_server.root / reply.json()["path"]).read_text())
        code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        assert 'workbench.compare(["cmp-nb-a", "cmp-nb-b"])' in code[0]
        assert nb["metadata"]["kernelspec"]["name"] == "workbench"
        for runs, status in (([ids[0]], 400), ([ids[0], ids[0]], 400), ("cmp-nb-a", 400),
                             ([ids[0], "no-such-run"], 404), ([ids[0], "../x"], 400)):
            bad = requests.post(url, json={"directory": "", "runs": runs},
                                headers=lab_server.auth, timeout=30)
            assert bad.status_code == status, (runs, bad.text)
    finally:
        for run_id in ids:
            Registry().delete_run(run_id)


def test_a_sweeps_trials_are_grouped_under_it(lab_server: LabServer, tmp_path, monkeypatch) -> None:
    """The runs list names each trial's sweep, read from the sweep's own record (a remote trial's
    status.json is a mirror that has no tag), and one row per sweep carries what the panel's
    group header shows: trials done / total, spend against the budget, the best objective."""
    import importlib
    import shutil
    import time as _time

    from workbench.runs.registry import Registry, RunRecord
    from workbench.runs.rundir import RunDir
    from workbench.spec import RunSpec

    # The record is written as the controller writes it; no controller runs (nothing trains).
    runner = importlib.import_module("workbench.sweep.runner")
    monkeypatch.setattr(runner, "start_controller", lambda record: None)
    sweep = workbench.sweep({"name": "lab-sweep", "budget": {"price_per_cpu_core_hour": 3600.0}},
                            space={"train.lr": [1e-3, 3e-3, 1e-2]}, budget=100.0)
    ended = {"lab-sw-t0": ("succeeded", 2.0, 0.42), "lab-sw-t1": ("pruned", 0.5, None),
             "lab-plain": ("succeeded", 1.0, None)}
    registry = Registry()
    for run_id, (state, cost, _) in ended.items():
        rd = RunDir(tmp_path / run_id).create(RunSpec(name=run_id))
        rd.write_status(state=state, cost=cost, released=_time.time())
        now = _time.time()
        registry.add_run(RunRecord(id=run_id, name=run_id, target="local", backend_job_id=None,
                                   run_dir=str(rd.path), state=state, created=now, updated=now))
    for n, run_id in enumerate(["lab-sw-t0", "lab-sw-t1"]):
        state, cost, value = ended[run_id]
        sweep.record.update_trial(n, params={"train.lr": [1e-3, 3e-3][n]}, run_id=run_id,
                                  state=state, cost=cost, value=value, released=True)
    sweep.record.update_trial(2, params={"train.lr": 1e-2}, state="waiting")
    # A fourth trial under way holds its limit: held, not spent.
    sweep.record.update_trial(3, params={"train.lr": 2e-3}, state="running", limit=7.5)
    try:
        body = requests.get(lab_server.api("runs"), headers=lab_server.auth, timeout=60).json()
        rows = {r["id"]: r for r in body["runs"]}
        assert rows["lab-sw-t0"]["sweep"] == {"sweep": sweep.id, "trial": 0}
        assert rows["lab-sw-t1"]["sweep"] == {"sweep": sweep.id, "trial": 1}
        assert rows["lab-sw-t1"]["state"] == "pruned"
        assert rows["lab-plain"]["sweep"] is None
        (group,) = [s for s in body["sweeps"] if s["id"] == sweep.id]
        assert group["runs"] == ["lab-sw-t0", "lab-sw-t1"]
        assert (group["trials_done"], group["trials_total"]) == (2, 3)
        assert group["spent"] == pytest.approx(2.0 + 0.5) and group["budget"] == 100.0
        assert group["held"] == pytest.approx(7.5)
        assert group["best"]["trial"] == 0 and group["best"]["value"] == 0.42
        assert group["objective"] == "eval_loss" and group["state"] == "running"
    finally:
        for run_id in ended:
            registry.delete_run(run_id)
        shutil.rmtree(sweep.record.path, ignore_errors=True)


def test_cards_of_runs_of_one_name_say_what_differs_and_their_score(lab_server: LabServer) -> None:
    """Two runs called the same differ only in their learning rate: each card says its own, and
    its evaluation score once it has one."""
    jobs = [workbench.launch({"name": "twin-card", "train": {"max_steps": 4, "lr": lr},
                              "data": {"eval_samples": 4}})
            for lr in (1e-3, 3e-3)]
    for job in jobs:
        assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=20)
    rows = {r["id"]: r for r in requests.get(f"{lab_server.url}/workbench/api/runs",
                                             headers=lab_server.auth, timeout=60).json()["runs"]}
    assert rows[jobs[0].id]["differs"] == "lr 0.001"
    assert rows[jobs[1].id]["differs"] == "lr 0.003"
    for job in jobs:
        lines = [ln for ln in (job.run_dir.path / "eval.jsonl").read_text().splitlines() if ln]
        assert lines, "the default schedule scores the run at its end"
        assert rows[job.id]["score"].startswith("heldout ")

    # Compare opens them side by side: what differs first, then results and scores, and curves.
    ids = ",".join(j.id for j in jobs)
    reply = requests.get(lab_server.api("compare") + f"?runs={ids}", headers=lab_server.auth,
                         timeout=60)
    assert reply.status_code == 200, reply.reason
    body = reply.json()
    kinds = [c["kind"] for c in body["columns"]]
    assert body["columns"][0]["label"] == "train.lr" and kinds[0] == "setting"
    assert kinds == sorted(kinds, key=["setting", "result", "score", "base"].index)
    assert [r["id"] for r in body["rows"]] == [j.id for j in jobs]
    assert [r["values"][0] for r in body["rows"]] == [0.001, 0.003]
    exact = next(i for i, c in enumerate(body["columns"])
                 if c["kind"] == "score" and c["label"] == "heldout exact_match")
    assert body["columns"][exact]["better"] == "higher"
    for job, row in zip(jobs, body["rows"], strict=True):
        newest = [json.loads(x) for x in (job.run_dir.path / "eval.jsonl").read_text().splitlines()
                  if x and json.loads(x)["model"] == "run"][-1]
        assert row["values"][exact] == newest["metrics"]["exact_match"]
        assert [p[0] for p in body["curves"][job.id]] == \
            [m["step"] for m in job.metrics() if "loss" in m and "event" not in m]
    one = requests.get(lab_server.api("compare") + f"?runs={jobs[0].id}", headers=lab_server.auth,
                       timeout=60)
    assert one.status_code == 400 and "two different run ids" in one.reason


def test_export_from_the_api_runs_once_at_a_time_and_its_report_shows_in_details(
        lab_server: LabServer) -> None:
    import os
    import signal

    job = workbench.launch({"name": "lab-export", "train": {"max_steps": 4},
                            "eval": {"tasks": []}})
    assert job.wait(timeout=600, progress=False) == "succeeded", job.logs(tail=20)
    url = lab_server.api(f"runs/{job.id}/export")
    bad = requests.post(url, headers=lab_server.auth, json={"formats": ["zip"]}, timeout=30)
    assert bad.status_code == 400 and "formats must be a list of" in bad.reason
    reply = requests.post(url, headers=lab_server.auth, json={"formats": ["merged"]}, timeout=30)
    assert reply.status_code == 202, reply.reason
    record = json.loads((job.run_dir.path / "export" / "panel.json").read_text())
    pid = record["process"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # held still: the second ask meets it under way
    try:
        again = requests.post(url, headers=lab_server.auth, json={"formats": ["merged"]},
                              timeout=30)
        assert again.status_code == 409 and "under way" in again.reason
        details = requests.get(lab_server.api(f"runs/{job.id}"), headers=lab_server.auth,
                               timeout=30).json()
        assert details["export"]["running"] and details["export"]["formats"] == ["merged"]
    finally:
        os.kill(pid, signal.SIGCONT)

    def ended() -> dict | None:
        d = requests.get(lab_server.api(f"runs/{job.id}"), headers=lab_server.auth,
                         timeout=30).json()["export"]
        return d if not d["running"] else None

    state = wait_for(ended, 600, "the panel's export to end")
    merged = Path(state["report"]["folders"]["merged"])
    assert (merged / "config.json").is_file() and (merged / "README.md").is_file()
    assert state["report"] == job.status()["export"]  # the library's own report, as recorded
