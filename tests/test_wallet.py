"""The wallet on real runs: a credit every launch, resume, sweep trial and evaluation draws from,
never overspent, refused before anything starts when short, settled from each run's own bill.

Real runs: 2 gloo ranks on the built-in tiny model, priced through budget.price_per_cpu_core_hour.
Each test has its own wallet (WORKBENCH_WALLET names a folder), so the session's other runs draw
from none. Money is checked against the ledger's own rows and against bills recomputed here from
the attempt times each run recorded (seconds x processes x price), never with the code's formula.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workbench
from tests.waiting import wait_for
from workbench.errors import CreditError
from workbench.runs.home import runs_dir

PRICE = 36.0  # per process-core-hour: 0.01 a second a process, 0.02 a second for a 2-rank run
SPEC = {"name": "wallet", "train": {"max_steps": 6, "lr": 3e-3}, "data": {"eval_samples": 8},
        "checkpoint": {"keep": 1}, "eval": {"tasks": []},
        "budget": {"price_per_cpu_core_hour": PRICE}}


@pytest.fixture
def wallet_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "wallet"
    monkeypatch.setenv("WORKBENCH_WALLET", str(folder))
    return folder


def _rows(folder: Path) -> list[dict]:
    """The ledger's rows as the database holds them (read with sqlite3, not the ledger)."""
    with sqlite3.connect(folder / "wallet.sqlite") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM entries ORDER BY id")]


def _sums(folder: Path) -> dict[str, int]:
    out = {k: 0 for k in ("credit", "grant", "hold", "charge", "release")}
    for r in _rows(folder):
        out[r["kind"]] += r["amount"]
    return out


def _balance(folder: Path) -> int:
    s = _sums(folder)
    return s["credit"] + s["grant"] - s["charge"] - (s["hold"] - s["release"])


def _recomputed_cents(status: dict, price: float = PRICE) -> int:
    """A run's bill from what it recorded: each attempt's held seconds x 2 processes x price."""
    seconds = float(status["billed_s"])
    return math.ceil(round(seconds * 2 * price / 3600 * 100, 6))


@pytest.mark.parametrize("amount", ["nan", "inf", "-1", "0", "ten", "1e300"])
def test_a_bad_amount_is_refused_and_nothing_is_written(wallet_dir: Path, amount: str) -> None:
    with pytest.raises(CreditError, match="number"):
        workbench.credit(amount)  # type: ignore[arg-type]
    assert not (wallet_dir / "wallet.json").exists()


def test_a_wallet_is_set_topped_up_and_never_set_lower(wallet_dir: Path) -> None:
    with pytest.raises(CreditError, match="no wallet is set"):
        workbench.credit()
    workbench.credit(2, "CNY")
    workbench.credit().add(0.5)
    with pytest.raises(CreditError, match="cannot be set lower"):
        workbench.credit(1, "CNY")
    with pytest.raises(CreditError, match="in CNY, not USD"):
        workbench.credit(5, "USD")
    with pytest.raises(CreditError, match="unknown wallet setting"):
        workbench.credit(endpoint_hold_minuts=3)
    assert _balance(wallet_dir) == 250
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "credit"], capture_output=True,
                         text=True, check=True, env=os.environ).stdout
    assert "balance 2.50 CNY" in out


def test_a_run_the_wallet_cannot_cover_is_refused_before_anything_starts(
        wallet_dir: Path) -> None:
    workbench.credit(0.05, "CNY")
    before = sorted(p.name for p in runs_dir().iterdir())
    with pytest.raises(CreditError) as err:
        workbench.launch({**SPEC, "name": "too-dear", "train": {"max_steps": 400}})
    assert "nothing was started" in str(err.value)
    assert "even its start-up and release" in str(err.value)  # no number of steps fits 0.05
    assert sorted(p.name for p in runs_dir().iterdir()) == before
    assert _balance(wallet_dir) == 5 and _sums(wallet_dir)["hold"] == 0


def test_the_steps_a_refusal_suggests_are_accepted(wallet_dir: Path) -> None:
    workbench.credit(1, "CNY")
    # Far more than the credit pays: the first plan in a fresh home put 5,000 steps anywhere
    # from 0.7 to 25 CNY (what its clock measured decided), so 5,000 sat on the line.
    dear = {**SPEC, "name": "dear", "train": {"max_steps": 50_000}}
    note = workbench.plan(dear).wallet_note
    assert note.startswith("this run is planned at"), note
    steps = int(re.search(r"train.max_steps of about (\d+)", note).group(1))
    fits = workbench.plan({**dear, "train": {"max_steps": steps}}).wallet_note
    assert fits.startswith("this run would hold"), fits
    assert _sums(wallet_dir)["hold"] == 0  # planning holds nothing


def test_a_launch_killed_after_its_hold_leaves_nothing_held(wallet_dir: Path) -> None:
    """kill -9 of a launching process once it holds: the next read of the wallet releases it."""
    workbench.credit(20, "CNY")
    gate = wallet_dir / "gate"
    code = ("import os, sys, workbench\n"
            "from workbench.runs import wallet\n"
            "real = wallet.Wallet.attach\n"
            "def stuck(self, *a, **k):\n"
            f"    open({str(gate)!r}, 'w').close()\n"
            "    import time\n"
            "    while True: time.sleep(1)\n"
            "wallet.Wallet.attach = stuck\n"
            f"workbench.launch({json.dumps({**SPEC, 'name': 'killed'})})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=os.environ)
    try:
        wait_for(gate.exists, 300, "the launch to hold its cost")
        assert _sums(wallet_dir)["hold"] > 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    workbench.credit()
    assert _sums(wallet_dir)["hold"] == _sums(wallet_dir)["release"]
    assert _balance(wallet_dir) == 2000  # nothing ran, nothing charged


def test_one_credit_pays_a_launch_an_evaluation_an_endpoint_and_a_sweep_and_never_more(
        wallet_dir: Path, served_run) -> None:
    """Issue 41's scenario on a credit of 1.00: a launch holds its plan and is charged its own
    bill; an evaluation holds its minutes and is charged its seconds; a real vLLM endpoint is
    paid block by block while a sweep runs beside it, and the keeper stops the endpoint when no
    block can be held; then what the rest cannot cover is refused before it starts. Nothing is
    charged past the credit, nothing stays held, and every charge is the one recomputed here
    from observed times (a run's recorded seconds, the endpoint's start and exit)."""
    from workbench.serve import deploy
    from workbench.serve.endpoint import LIVE_STATES, get_endpoint

    price = 7.2  # a process-core-hour: 0.004 a second for a 2-rank run
    rate = 48.0  # an endpoint-hour: a block of 15 s is 0.20
    spec = {**SPEC, "budget": {"price_per_cpu_core_hour": price}}
    workbench.credit(1.0, "CNY", endpoint_price_per_hour=rate, endpoint_hold_minutes=0.25,
                     endpoint_idle_minutes=60, eval_hold_minutes=0.25)

    job = workbench.launch({**spec, "name": "wallet-run"})
    held = [r for r in _rows(wallet_dir) if r["kind"] == "hold"]
    assert len(held) == 1 and 0 < held[0]["amount"] < 100
    assert job.spec.budget.limit == held[0]["amount"] / 100  # the run stops at its hold
    assert _balance(wallet_dir) == 100 - held[0]["amount"]
    assert job.wait(timeout=600, progress=False) == "succeeded"
    workbench.credit()  # settles what ended
    run_bills = [_recomputed_cents(job.status(), price)]
    assert _sums(wallet_dir)["charge"] == run_bills[0]

    before = _balance(wallet_dir)
    started = time.time()
    job.evaluate(["heldout"], max_samples=4)
    took = time.time() - started
    hold = next(r for r in _rows(wallet_dir) if r["kind"] == "hold"
                and r["note"] == f"evaluation of {job.id}")
    assert hold["amount"] == 6  # a quarter of a minute at 0.004 a second
    eval_charge = before - _balance(wallet_dir)
    assert 0 < eval_charge <= math.ceil(took * 2 * price / 3600 * 100)

    # The sweep's first trial holds its plan before the endpoint starts, so the endpoint (paid
    # block by block from its start, however long vLLM takes to answer here) cannot take the
    # credit every trial needs before one is held. The deploy does not wait for vLLM to answer:
    # on a loaded machine the credit may run out while it still starts, and the keeper stops it
    # then, which is what is under test either way.
    holds = len([r for r in _rows(wallet_dir) if r["kind"] == "hold"])
    s = workbench.sweep(spec, space={"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}},
                        strategy="random", trials=4)
    wait_for(lambda: len([r for r in _rows(wallet_dir) if r["kind"] == "hold"]) > holds, 300,
             "the sweep's first trial to hold its plan", every=0.5)
    ep = deploy(served_run, name="wallet-ep", progress=False, wait=False)
    s.wait(timeout=1200, progress=False)
    def endpoint_settled() -> bool:
        rows = _rows(wallet_dir)
        blocks = {r["id"] for r in rows if r["kind"] == "hold"
                  and r["note"].startswith("endpoint wallet-ep")}
        released = {r["hold_id"] for r in rows if r["kind"] == "release"}
        return (get_endpoint("wallet-ep").record.state not in LIVE_STATES
                and bool(blocks) and blocks <= released)

    wait_for(endpoint_settled, 600, "the keeper to stop the endpoint and settle its blocks",
             every=1.0)
    workbench.credit()  # settles the sweep's last trial
    assert _sums(wallet_dir)["hold"] == _sums(wallet_dir)["release"]  # nothing left held
    assert ep.money_note() == "stopped: the credit ran out"
    run_bills += [_recomputed_cents(workbench.get_job(t["run_id"]).status(), price)
                  for t in s.trials if t.get("run_id")]
    assert len(run_bills) >= 2  # the sweep's first trial, held before the endpoint, ran

    rows = _rows(wallet_dir)
    what = {r["id"]: r["note"] for r in rows if r["kind"] == "hold"}
    charges: dict[str, int] = {"run": 0, "evaluation": 0, "endpoint": 0}
    for r in rows:
        if r["kind"] == "charge":
            note = what[r["hold_id"]]
            kind = ("endpoint" if note.startswith(("endpoint", "deploy")) else
                    "evaluation" if note.startswith("evaluation") else "run")
            charges[kind] += r["amount"]
    assert charges["run"] == sum(run_bills)
    assert charges["evaluation"] == eval_charge
    blocks = [r for r in rows if r["kind"] == "hold" and what[r["id"]].startswith(
        ("endpoint", "deploy"))]
    with sqlite3.connect(wallet_dir / "wallet.sqlite") as db:
        since = min(r[0] for r in db.execute("SELECT created FROM runs WHERE kind='endpoint'"))
    ended = json.loads((ep.dir / "exit.json").read_text())["time"]
    up_cents = rate / 3600 * (ended - since) * 100
    assert abs(charges["endpoint"] - up_cents) <= len(blocks) + 1, (charges, up_cents)
    assert sum(charges.values()) == _sums(wallet_dir)["charge"] <= 100
    assert 0 <= _balance(wallet_dir) == 100 - sum(charges.values())

    # What is left (the sweep's trials release what they held but did not spend after the
    # endpoint stopped, so it is not bounded by one block) cannot pay an endpoint block priced
    # two cents above it, nor a long run: refused, nothing started.
    left = _balance(wallet_dir)
    workbench.credit(endpoint_hold_minutes=(left + 2) / 100 / rate * 60)
    with pytest.raises(CreditError, match="nothing was started"):
        deploy(served_run, name="wallet-ep-2", progress=False)
    assert not (Path(os.environ["WORKBENCH_HOME"]) / "endpoints" / "wallet-ep-2").exists()
    with pytest.raises(CreditError, match="nothing was started"):
        workbench.launch({**spec, "name": "too-dear", "train": {"max_steps": 4000}})
    assert _balance(wallet_dir) == left


def test_an_evaluation_past_its_hold_is_stopped_and_charged_no_more(wallet_dir: Path) -> None:
    """An evaluation on this machine holds eval_hold_minutes; one that would run longer (its
    judge holds every answer) is stopped there with a one-line error and charged at most its
    hold, and the judge is asked nothing more."""
    from tests.evaluate_support import JudgeServer
    from workbench.errors import EvalError

    workbench.credit(1.0, "CNY", eval_hold_minutes=0.1)  # 6 s at 0.02 a second: 12 cents
    job = workbench.launch({**SPEC, "name": "wallet-eval-stop"})
    assert job.wait(timeout=600, progress=False) == "succeeded"
    workbench.credit()  # settles the run
    charged_before = _sums(wallet_dir)["charge"]
    judge = JudgeServer()
    judge.mode = "hold"
    try:
        started = time.time()
        with pytest.raises(EvalError, match="stopped at its wallet hold") as stopped:
            job.evaluate([{"kind": "judge", "judge": judge.url}])
        took = time.time() - started
    finally:
        judge.release.set()
        judge.close()
    assert "\n" not in str(stopped.value) and "eval_hold_minutes" in str(stopped.value)
    # At its hold: not when the judge lets its held answers go (60 s), nor after the answers
    # still queued at the stop (16 for the 8 validation questions) had each been held too.
    assert 6 - 1.5 <= took < 6 + 15, took
    hold = next(r for r in _rows(wallet_dir) if r["kind"] == "hold"
                and r["note"] == f"evaluation of {job.id}")
    assert hold["amount"] == 12
    charge = _sums(wallet_dir)["charge"] - charged_before
    assert 0 < charge <= hold["amount"]
    assert _sums(wallet_dir)["hold"] == _sums(wallet_dir)["release"]


@pytest.mark.slow  # a server paid block by block until the credit runs out: half a minute
def test_a_keeper_killed_mid_way_is_started_again_and_the_endpoint_is_paid_to_its_end(
        wallet_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of the wallet's keeper while an endpoint holds: `workbench credit` starts it
    again, it catches up block by block, stops the endpoint when the credit runs out, and every
    block is settled once. The endpoint is a stand-in server registered as one (vLLM takes minutes
    to start; what is under test reads only the registry, the process and its /metrics)."""
    import psutil

    from workbench.runs.registry import EndpointRecord, Registry
    from workbench.runs.wallet import keeper_lock
    from workbench.serve.endpoint import LIVE_STATES, get_endpoint, refresh_state
    from workbench.serve.metering import hold_first_block, settle_start

    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    folder = tmp_path / "home" / "endpoints" / "stand-in"
    folder.mkdir(parents=True)
    (folder / "metrics").write_text('vllm:num_requests_running{model_name="m"} 1.0\n')
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1",
                               "--directory", str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        port = int(server.stdout.readline().split("port ")[1].split()[0])  # its first line
        now = time.time()
        Registry().add_endpoint(EndpointRecord(
            name="stand-in", target="local", url=f"http://127.0.0.1:{port}", state="healthy",
            pid=server.pid, server_pid=None, endpoint_dir=str(folder), serves="{}",
            created=now, updated=now))
        rate = 36.0  # an hour: 1 cent a second; blocks of 6 s are 6 cents: two, not three
        workbench.credit(0.15, "CNY", endpoint_price_per_hour=rate, endpoint_hold_minutes=0.1)
        paid = hold_first_block(None, "stand-in", folder)
        assert paid is not None
        settle_start(paid, ok=True)  # up: the keeper's from here on

        def keeper() -> psutil.Process | None:
            for p in psutil.process_iter(["cmdline"]):
                if "workbench.serve.metering" in " ".join(p.info["cmdline"] or []):
                    return p
            return None

        wait_for(lambda: len([r for r in _rows(wallet_dir) if r["kind"] == "hold"]) >= 2, 60,
                 "the keeper to hold a second block")
        first = keeper()
        assert first is not None
        first.kill()
        first.wait(10)
        open_holds = _sums(wallet_dir)["hold"] - _sums(wallet_dir)["release"]
        assert open_holds > 0  # the endpoint's blocks wait for a keeper
        workbench.credit()  # starts a keeper again
        wait_for(lambda: refresh_state("stand-in").state not in LIVE_STATES
                 and _sums(wallet_dir)["hold"] == _sums(wallet_dir)["release"], 120,
                 "the new keeper to stop the endpoint when the credit runs out", every=0.5)
        assert keeper() is None or keeper().pid != first.pid
        assert get_endpoint("stand-in").money_note() == "stopped: the credit ran out"
        # Left: less than the block it could not hold, plus what the block it stopped in had
        # not used yet (the next block is asked for half a block before this one ends).
        assert 0 <= _balance(wallet_dir) < 6 + 3
        releases = [r["hold_id"] for r in _rows(wallet_dir) if r["kind"] == "release"]
        assert len(releases) == len(set(releases))  # each block settled once
        assert keeper_lock().exists()
    finally:
        server.kill()
        server.wait()
