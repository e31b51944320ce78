"""The course ledger on a real SQLite file: sums, refusals, settling once, and holds racing from
threads and from separate processes (only as many pass as the credit pays for)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.waiting import wait_for
from workbench.errors import CourseError, InsufficientCreditError
from workbench.runs.ledger import Ledger, to_minor


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.open_account("ana", 1000, actor="test")
    return led


def test_balance_follows_credit_grant_hold_and_settle(ledger: Ledger) -> None:
    ledger.grant("ana", 250, actor="teacher")
    hold = ledger.hold("ana", 300, actor="ana")
    assert ledger.balance("ana") == 950  # 1000 + 250 - 300 held
    assert ledger.settle(hold, 120, actor="svc")
    account = ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (120, 0, 1130)
    assert [e["kind"] for e in ledger.entries("ana")] == ["credit", "grant", "hold", "charge",
                                                          "release"]


def test_a_hold_past_the_balance_is_refused_and_writes_nothing(ledger: Ledger) -> None:
    ledger.hold("ana", 700, actor="ana")
    before = ledger.entries()
    with pytest.raises(InsufficientCreditError, match="ask an instructor"):
        ledger.hold("ana", 301, actor="ana")
    assert ledger.entries() == before
    ledger.hold("ana", 300, actor="ana")  # exactly what is left still fits
    assert ledger.balance("ana") == 0


def test_settling_twice_charges_once(ledger: Ledger) -> None:
    hold = ledger.hold("ana", 500, actor="ana")
    assert ledger.settle(hold, 400, actor="svc")
    assert not ledger.settle(hold, 400, actor="svc")
    assert ledger.balance("ana") == 600


def test_rows_are_in_the_database_not_the_object(ledger: Ledger, tmp_path: Path) -> None:
    hold = ledger.hold("ana", 200, actor="ana")
    ledger.attach_run(hold, "run-1", "/runs/run-1")
    again = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    [open_hold] = again.holds(open_only=True)
    assert (open_hold.run_id, open_hold.amount, open_hold.charge) == ("run-1", 200, None)
    again.settle(open_hold.hold_id, 50, actor="svc")
    assert ledger.holds(open_only=True) == [] and ledger.balance("ana") == 950


def test_a_resumed_run_has_one_hold_per_attempt(ledger: Ledger) -> None:
    """A run's launch and its resume each hold; the run's view is its newest attempt, and an
    evaluation of it (another kind of hold) is not an attempt."""
    first = ledger.hold("ana", 200, actor="ana")
    ledger.attach_run(first, "run-1", "/runs/run-1")
    ledger.settle(first, 120, actor="svc")
    again = ledger.hold("ana", 300, actor="ana")
    ledger.attach_run(again, "run-1", "/runs/run-1", kind="resume", base_cost=1.2)
    scored = ledger.hold("ana", 10, actor="ana")
    ledger.attach_run(scored, "run-1", "/runs/run-1", kind="evaluate")
    newest = ledger.run_hold("run-1")
    assert (newest.hold_id, newest.kind, newest.base_cost) == (again, "resume", 1.2)
    assert ledger.account("ana").held == 310 and ledger.balance("ana") == 1000 - 120 - 310
    with pytest.raises(CourseError, match="pays for one of"):
        ledger.attach_run(ledger.hold("ana", 1, actor="ana"), "run-1", "/x", kind="refund")


@pytest.mark.parametrize("amount", [-5, 0, 1.5])
def test_bad_grants_are_refused(ledger: Ledger, amount: object) -> None:
    with pytest.raises(CourseError):
        ledger.grant("ana", amount, actor="teacher")  # type: ignore[arg-type]
    assert ledger.balance("ana") == 1000


def test_unknown_student_is_refused(ledger: Ledger) -> None:
    with pytest.raises(CourseError, match="not a student"):
        ledger.hold("eve", 1, actor="eve")


def test_minor_units_round_up_and_are_exact() -> None:
    assert to_minor(0.4301) == 44
    assert to_minor(0.43) == 43
    assert to_minor("0.1") * 3 == to_minor("0.3")
    assert to_minor(2, minor_per_unit=1000) == 2000
    # A quarter of a minute at 14.4 an hour is 0.06 exactly; float arithmetic makes it
    # 0.060000000000000005, which must not cost a seventh cent.
    assert to_minor(14.4 * 0.25 / 60) == 6
    assert to_minor(0.0600001) == 7  # a real excess still rounds up


# One process holding 6 units once the parent says go (a file): several of them race for the
# last credit as separate processes would (the service restarted, two workers).
_HOLDER = """
import sys, time
from pathlib import Path
from workbench.runs.ledger import Ledger
from workbench.errors import InsufficientCreditError
url, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
led = Ledger(url)
ready.touch()
while not go.exists():
    time.sleep(0.002)
try:
    led.hold("ana", 600, actor="ana")
    print("held")
except InsufficientCreditError:
    print("refused")
"""


def test_concurrent_holds_from_processes_cannot_both_pass(ledger: Ledger, tmp_path: Path) -> None:
    n, go = 4, tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, ledger.url, str(r), str(go)],
                              stdout=subprocess.PIPE, text=True) for r in ready]
    wait_for(lambda: all(r.exists() for r in ready), timeout=120, what="every holder ready")
    go.touch()
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outcomes == ["held"] + ["refused"] * (n - 1)
    assert ledger.balance("ana") == 400


def test_concurrent_holds_from_threads_cannot_both_pass(ledger: Ledger,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Widen the gap between reading the balance and writing the hold, so a ledger that did not
    # lock before reading would let several holds through every time, not just sometimes.
    read = Ledger._account

    def slow_read(self: Ledger, db: object, student: str) -> object:
        account = read(self, db, student)  # type: ignore[arg-type]
        time.sleep(0.05)
        return account

    monkeypatch.setattr(Ledger, "_account", slow_read)
    n = 8
    barrier, outcomes = threading.Barrier(n), []

    def hold() -> None:
        barrier.wait()
        try:
            ledger.hold("ana", 300, actor="ana")
            outcomes.append("held")
        except InsufficientCreditError:
            outcomes.append("refused")

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["held"] * 3 + ["refused"] * 5  # 3 x 300 fit in 1000
    assert ledger.balance("ana") == 100


def test_a_sweep_hold_is_drawn_down_by_its_trials_and_its_rest_released(ledger: Ledger) -> None:
    """One hold for a whole sweep: each trial charged against it once, never past it; the rest
    comes back with the release; every fen counted once throughout."""
    hold = ledger.hold("ana", 600, actor="ana")
    ledger.attach_run(hold, "sweep-1", "/sweeps/sweep-1", kind="sweep")
    assert ledger.charge_trial(hold, "run-a", 250, actor="svc") == 250
    assert ledger.charge_trial(hold, "run-a", 250, actor="svc") is None  # once per trial
    account = ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (250, 350, 400)
    assert ledger.hold_left(hold) == 350
    # A trial billed past what is left of the hold is charged what is left, no more.
    assert ledger.charge_trial(hold, "run-b", 400, actor="svc") == 350
    assert ledger.balance("ana") == 400 and ledger.account("ana").held == 0
    assert ledger.settle(hold, 0, actor="svc", note="sweep ended")
    assert ledger.charge_trial(hold, "run-c", 10, actor="svc") is None  # settled: no more
    account = ledger.account("ana")
    assert (account.charges, account.held, account.balance) == (600, 0, 400)
    assert ledger.charged_trials(hold) == {"run-a": 250, "run-b": 350}
    assert [e["kind"] for e in ledger.entries("ana")] == ["credit", "hold", "charge", "charge",
                                                          "charge", "release"]


def test_a_sweep_that_ends_early_gives_back_the_rest(ledger: Ledger) -> None:
    hold = ledger.hold("ana", 600, actor="ana")
    ledger.charge_trial(hold, "run-a", 120, actor="svc")
    assert ledger.balance("ana") == 400
    ledger.settle(hold, 0, actor="svc")
    assert ledger.balance("ana") == 880 and ledger.account("ana").held == 0
