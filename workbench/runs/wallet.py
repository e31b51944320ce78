"""The wallet: one credit per WORKBENCH_HOME that every launch, resume, evaluation, sweep trial
and endpoint of its owner draws from, never overspent.

It is the course's ledger (:mod:`.ledger`) with one account, :data:`OWNER`, in
WORKBENCH_HOME/wallet.sqlite (or in the folder WORKBENCH_WALLET names, shared by several homes);
its currency and settings are in wallet.json beside it. Work holds its planned
cost before anything starts and is refused (:class:`~workbench.errors.CreditError`, saying what
would fit) when the balance cannot cover it. A run is then limited to its hold (its
``budget.limit``: the supervisor stops it before passing it), and the hold is settled from the
run's final bill once it ended (:meth:`Wallet.settle_ended`, called whenever the wallet is read or
held from). Endpoints are held block by block (:mod:`workbench.serve.metering`). Without a wallet
nothing changes: per-run limits work as they do alone.

    >>> Wallet.create(10, "CNY")                    # doctest: +SKIP
    >>> Wallet.open().account().balance            # minor units  # doctest: +SKIP
    1000

``workbench.credit()`` (:mod:`.credit`) is the same wallet with its views.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import CreditError, InsufficientCreditError, WorkbenchError
from workbench.runs.home import home
from workbench.runs.ledger import Ledger, RunHold, to_minor
from workbench.runs.procs import ProcessIdentity
from workbench.runs.rundir import TERMINAL, RunDir

if TYPE_CHECKING:
    from typing_extensions import Self

OWNER = "owner"  # the wallet's one account in its ledger
MAX_AMOUNT = 1e9  # currency units: far above any credit, far below what the ledger can keep
# A run without its own budget.limit holds its planned cost times this, plus what it needs to stop
# in time (plans can be short; the run stops at its hold and a resume holds again).
HOLD_MARGIN = 1.5
# A run that ended without its supervisor marking ``released`` (it was killed) is settled with
# what status.json last billed once it ended this long ago.
UNRELEASED_SETTLE_S = 120.0
IMPOSED = "wallet_limit"  # in a run directory: its budget.limit was set by the wallet
SETTINGS = {"endpoint_hold_minutes": 10.0, "endpoint_idle_minutes": 30.0,
            "endpoint_warn_minutes": 30.0, "eval_hold_minutes": 30.0,
            "endpoint_price_per_hour": None}


WALLET_ENV = "WORKBENCH_WALLET"  # a folder holding a wallet shared by several homes


def wallet_dir() -> Path:
    """WORKBENCH_HOME, or the folder WORKBENCH_WALLET names (one account for several homes)."""
    named = os.environ.get(WALLET_ENV)
    if not named:
        return home()
    folder = Path(named).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wallet_files() -> tuple[Path, Path]:
    return wallet_dir() / "wallet.json", wallet_dir() / "wallet.sqlite"


@dataclass
class Wallet:
    currency: str
    minor_per_unit: int
    settings: dict[str, Any]
    ledger: Ledger
    # How a run's status is read when settling: through its backend, which records how an
    # attempt whose processes are gone ended (given by callers that reach the backends);
    # status.json as it is without it.
    status_of: Callable[[str], dict[str, Any]] | None = None

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, status_of: Callable[[str], dict[str, Any]] | None = None) -> Self | None:
        """The wallet of this WORKBENCH_HOME, or None when none was set."""
        conf, db = wallet_files()
        try:
            data = json.loads(conf.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise CreditError(f"{conf} is not valid JSON ({exc}); fix it, or remove it and "
                              f"{db.name} to start a new wallet") from None
        return cls(str(data["currency"]), int(data.get("minor_per_unit", 100)),
                   {**SETTINGS, **(data.get("settings") or {})}, Ledger(f"sqlite:///{db}"),
                   status_of)

    @classmethod
    def create(cls, amount: float, currency: str = "CNY", **settings: Any) -> Wallet:
        """Start a wallet with ``amount``; an existing one of the same currency is topped up to
        ``amount`` (its history is never rewritten, so it cannot be lowered)."""
        amount = _positive(amount, "a credit")
        _check_settings(settings)
        existing = cls.open()
        if existing is not None:
            if existing.currency != currency.upper():
                raise CreditError(f"this wallet is in {existing.currency}, not {currency}; a "
                                  "wallet keeps one currency")
            existing.configure(**settings)
            more = existing.minor(amount) - existing.account().balance
            if more < 0:
                raise CreditError(
                    f"the wallet already has {existing.money(existing.account().balance)}; its "
                    "history is never rewritten, so it cannot be set lower. Add to it with "
                    "`workbench credit add AMOUNT`")
            if more:
                existing.ledger.grant(OWNER, more, actor=_actor(), note=f"set to {amount:g}")
            return existing
        conf, db = wallet_files()
        wallet = cls(currency.upper(), 100, {**SETTINGS, **settings}, Ledger(f"sqlite:///{db}"))
        # The account first: wallet.json is what makes the wallet exist, so it is never there
        # without its account.
        wallet.ledger.open_account(OWNER, wallet.minor(amount), actor=_actor())
        wallet._save(wallet.settings)
        return wallet

    def _save(self, settings: dict[str, Any]) -> None:
        conf, _ = wallet_files()
        tmp = conf.with_suffix(".tmp")
        tmp.write_text(json.dumps({"currency": self.currency, "minor_per_unit":
                                   self.minor_per_unit, "settings": settings}, indent=1))
        os.replace(tmp, conf)
        self.settings = settings

    def configure(self, **settings: Any) -> None:
        if settings:
            self._save({**self.settings, **_check_settings(settings)})

    def add(self, amount: float, note: str = "") -> None:
        self.ledger.grant(OWNER, self.minor(_positive(amount, "an amount")), actor=_actor(),
                          note=note)

    # -- money -----------------------------------------------------------------------------------
    def minor(self, amount: float) -> int:
        return to_minor(amount, self.minor_per_unit)

    def money(self, minor: int) -> str:
        return f"{minor / self.minor_per_unit:.2f} {self.currency}"

    def account(self) -> Any:
        return self.ledger.account(OWNER)

    # -- holding ---------------------------------------------------------------------------------
    def hold(self, amount: int, what: str) -> int:
        """Set ``amount`` (minor units) aside for ``what``; refused, with nothing written, when
        the balance is short. The hold records the process taking it, so a hold whose taker
        died before it named its run is released by the next :meth:`settle_ended`."""
        try:
            hold_id = self.ledger.hold(OWNER, amount, actor=_actor(), note=what)
        except InsufficientCreditError as exc:
            raise CreditError(f"{what} needs a hold of {self.money(amount)} but the wallet has "
                              f"{self.money(exc.balance)} left, so nothing was started; "
                              "`workbench credit` shows what is held and by what") from None
        _taker_file(hold_id).write_text(json.dumps(ProcessIdentity.me("wallet").to_dict()))
        return hold_id

    def attach(self, hold_id: int, kind: str, run_id: str, run_dir: str = "",
               base_cost: float = 0.0, since: float | None = None,
               imposed: bool = False) -> None:
        """Record what ``hold_id`` pays for; ``imposed``: the run's budget.limit is the wallet's
        hold, not the user's (marked in the run directory, so a resume holds afresh)."""
        if imposed:
            (Path(run_dir) / IMPOSED).write_text("budget.limit is this run's wallet hold\n")
        self.ledger.attach_run(hold_id, run_id, run_dir, kind=kind, base_cost=base_cost,
                               since=since)
        _taker_file(hold_id).unlink(missing_ok=True)

    def release(self, hold_id: int, charge: int, note: str) -> bool:
        done = self.ledger.settle(hold_id, charge, actor=_actor(), note=note)
        _taker_file(hold_id).unlink(missing_ok=True)
        return done

    def hold_run(self, spec: Any, planned_cost: float | None, what: str, spent: float = 0.0,
                 limit: float | None = None, fixed_cost: float = 0.0) -> tuple[Any, int | None]:
        """Hold a launch's or resume's cost (:meth:`run_amount`): the spec limited to ``spent``
        + its hold, and the hold (None for a run with no price: it draws nothing)."""
        self.settle_ended()
        amount = self.run_amount(spec, planned_cost, what, spent, limit, fixed_cost)
        if amount is None:
            return spec, None
        hold_id = self.hold(amount, what)
        return spec.updated(**{"budget.limit": spent + amount / self.minor_per_unit}), hold_id

    def run_amount(self, spec: Any, planned_cost: float | None, what: str, spent: float = 0.0,
                   limit: float | None = None, fixed_cost: float = 0.0) -> int | None:
        """What a launch or resume of ``spec`` would hold (minor units): ``limit`` (the user's
        own, less ``spent``) when given, else the plan's cost with a margin; None for a run with
        no price. Refused when the wallet cannot cover the plan, saying how many steps would fit
        (``fixed_cost``: the part of the plan's cost that fewer steps do not lower)."""
        from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, STOP_S, hourly_price

        price, currency = hourly_price(spec)
        if price <= 0:
            return None
        # What a limited run keeps free to stop in time: its graceful stop, the release, and the
        # kill that follows a stop too slow (workbench.runs.budget).
        margin = price * (STOP_S + RELEASE_S + KILL_GRACE_S) / 3600
        if currency != self.currency:
            raise CreditError(f"{what} is priced in {currency} but the wallet is in "
                              f"{self.currency}; set budget.currency and a price in "
                              f"{self.currency} (budget.price_per_gpu_hour, or the card's price "
                              "in WORKBENCH_HOME/gpus.yaml)")
        balance = self.account().balance
        if limit is not None:  # the user's own limit is what may be spent: it is held
            return self.minor(max(0.0, limit - spent))
        if planned_cost is None:
            raise CreditError(f"the plan cannot price {what} (its number of steps is unknown), "
                              "so the wallet cannot hold it; set budget.limit (what it may "
                              "spend) or train.max_steps")
        need = self.minor(planned_cost + margin)
        if need > balance:
            raise CreditError(f"{what} is planned at {self.money(need)} but the wallet has "
                              f"{self.money(balance)} left, so nothing was started; "
                              + _what_fits(spec, planned_cost + margin, fixed_cost + margin,
                                           balance / self.minor_per_unit))
        return min(balance, self.minor(planned_cost * HOLD_MARGIN + margin))

    def quote(self, spec: Any, planned_cost: float | None, fixed_cost: float = 0.0) -> str | None:
        """The plan's line about the wallet: what the run would hold of what is left, or why
        the wallet could not hold it; None for a run with no price."""
        try:
            amount = self.run_amount(spec, planned_cost, "this run", limit=spec.budget.limit,
                                     fixed_cost=fixed_cost)
        except CreditError as exc:
            return str(exc).replace(", so nothing was started", "")
        if amount is None:
            return None
        return (f"this run would hold {self.money(amount)} of the wallet's "
                f"{self.money(self.account().balance)}, and stop there")

    def hold_resume(self, rd: RunDir, spec: Any, spent: float, given: float | None,
                    planned_cost: float | None, what: str) -> tuple[Any, int | None]:
        """:meth:`hold_run` for a resume of a run that has spent ``spent``, planned again as a
        whole run (``planned_cost``: a resume from a snapshot adds at most that much). The
        user's limit is ``given`` (a new one), else the run's own unless the wallet set it
        (:data:`IMPOSED`)."""
        limit = given
        if limit is None and not (rd.path / IMPOSED).is_file():
            limit = spec.budget.limit
        return self.hold_run(spec, planned_cost, what, spent=spent, limit=limit)

    def covers(self, amount: float, what: str) -> None:
        """Refuse ``what`` (a sweep's budget) when it is more than the wallet has left."""
        self.settle_ended()
        balance = self.account().balance
        if self.minor(amount) > balance:
            raise CreditError(f"{what} is {self.money(self.minor(amount))} but the wallet has "
                              f"{self.money(balance)} left; lower it to at most that")

    def hold_time(self, spec: Any, minutes: float, what: str, kind: str, run_id: str,
                  run_dir: str = "") -> tuple[int, float] | None:
        """Hold ``minutes`` of ``spec``'s hourly price for work charged by the second it runs
        (an evaluation): the hold and the price, or None when the work has no price."""
        from workbench.runs.budget import hourly_price

        price, currency = hourly_price(spec)
        if price <= 0:
            return None
        if currency != self.currency:
            raise CreditError(f"{what} is priced in {currency} but the wallet is in "
                              f"{self.currency}")
        self.settle_ended()
        hold_id = self.hold(self.minor(price * minutes / 60), what)
        self.ledger.attach_run(hold_id, run_id, run_dir, kind=kind)  # its taker settles it
        return hold_id, price

    def charge_time(self, hold_id: int, price: float, seconds: float, note: str) -> None:
        self.release(hold_id, self.minor(price * seconds / 3600),
                     f"{note}: {seconds:.0f} s at {price:g} {self.currency}/h")

    # -- settling --------------------------------------------------------------------------------
    def settle_ended(self) -> list[str]:
        """Charge and release every open hold whose work has ended: a run from its final bill
        (status.json's ``cost`` less what it had billed before this hold), at most the hold; a
        hold whose taker died before naming its work, nothing; an evaluation whose process died,
        its whole hold (:attr:`status_of` reads a run's status). The run ids settled."""
        settled = []
        for h in self.ledger.holds(OWNER, open_only=True):
            if h.run_id is None:
                if not _taker_alive(h.hold_id) and self.release(
                        h.hold_id, 0, "its launch ended before it started anything"):
                    settled.append(f"hold {h.hold_id}")
                continue
            if h.kind in ("evaluate", "export"):  # settled by the process doing it, unless it died:
                if not _taker_alive(h.hold_id) and self.release(  # then all it could have used
                        h.hold_id, h.amount, f"{h.kind} {h.run_id} (its process ended unseen)"):
                    settled.append(str(h.run_id))
                continue
            if h.kind not in ("launch", "resume"):
                continue  # endpoints: workbench.serve.metering
            charge = self._run_charge(h)
            if charge is not None and self.release(h.hold_id, charge, f"{h.kind} {h.run_id}"):
                settled.append(h.run_id)
        return settled

    def _run_charge(self, h: RunHold) -> int | None:
        rd = RunDir(h.run_dir or "")
        if not rd.path.is_dir():  # refused and removed by a launch that then died
            return 0
        try:
            status = self.status_of(str(h.run_id)) if self.status_of else rd.status()
        except WorkbenchError:
            status = rd.status()
        ended = status.get("ended") or status.get("released")
        if status.get("state") not in TERMINAL:
            return None
        if "released" not in status and (ended is None
                                         or time.time() - float(ended) < UNRELEASED_SETTLE_S):
            return None  # the supervisor is writing its final bill
        cost = float(status.get("cost") or 0.0)
        return max(0, self.minor(max(0.0, cost - h.base_cost)))


def keeper_lock() -> Path:
    return wallet_dir() / "wallet-keeper.lock"


def ensure_keeper() -> None:
    """Start the wallet's keeper (``python -m workbench.serve.metering``) unless one runs: it
    meters the endpoints that hold from the wallet, and ends when none does."""
    import fcntl
    import subprocess
    import sys

    with open(keeper_lock(), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # a keeper holds it
    log = open(wallet_dir() / "wallet-keeper.log", "ab")  # noqa: SIM115 - the child keeps it
    with log:
        subprocess.Popen([sys.executable, "-m", "workbench.serve.metering"], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         cwd=wallet_dir())


def release_taker(hold_id: int) -> None:
    """The process that took ``hold_id`` hands it over (to the keeper)."""
    _taker_file(hold_id).unlink(missing_ok=True)


def deploy_under_way(hold_id: int) -> bool:
    """An endpoint block whose deploy (its taker) is still starting the server."""
    return _taker_alive(hold_id)


def _what_fits(spec: Any, planned_cost: float, fixed_cost: float, left: float) -> str:
    """What would fit in ``left``: the steps whose share of the plan's cost, beside its fixed part
    (start-up, release and the stop margin), ``left`` still pays, with 10 % to spare."""
    steps = spec.train.max_steps
    per_step = (planned_cost - fixed_cost) / steps if steps else 0.0
    fit = int((left - fixed_cost) / per_step * 0.9) if per_step > 0 else 0
    if fit < 1:
        return (f"even its start-up and release ({fixed_cost:.2f}) cost more than that: a "
                "cheaper card (resources.gpu_type), or more credit (`workbench credit add "
                "AMOUNT`)")
    return (f"fewer steps would fit (train.max_steps of about {fit}), a cheaper card "
            "(resources.gpu_type), or more credit (`workbench credit add AMOUNT`)")


def _check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise CreditError(f"unknown wallet setting(s) {sorted(unknown)}; known: "
                          f"{sorted(SETTINGS)}")
    for key, value in settings.items():
        if value is not None:
            _positive(value, key)
    return settings


def _positive(amount: Any, what: str) -> float:
    try:
        value = float(amount)
    except (TypeError, ValueError):
        raise CreditError(f"{what} must be a number, got {amount!r}") from None
    if not 0 < value <= MAX_AMOUNT:
        raise CreditError(f"{what} must be a number above zero and at most {MAX_AMOUNT:.0f}, "
                          f"got {amount!r}")
    return value


def _actor() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _taker_file(hold_id: int) -> Path:
    folder = wallet_dir() / "wallet-holds"
    folder.mkdir(exist_ok=True)
    return folder / f"{hold_id}.json"


def _taker_alive(hold_id: int) -> bool:
    try:
        ident = ProcessIdentity.from_dict(json.loads(_taker_file(hold_id).read_text()))
    except (OSError, ValueError, KeyError):
        return False
    return ident.alive()

