"""Endpoints paid block by block from a ledger account: the meter a course's service and a
wallet's keeper both tick.

An endpoint's time is held in blocks (a ``hold`` of kind ``endpoint`` in :mod:`workbench.runs.ledger`,
its ``run_id`` the endpoint's name, ``since`` when its time starts); a block's amount is its
price, so an endpoint's hourly rate is ``amount / block_s * 3600``. :meth:`BlockMeter.tick` holds
the next block shortly before the current one ends; when that hold is refused the endpoint is
stopped at once, so it never runs on time nobody paid for. A block is charged in full once its
time has passed; the block in which the endpoint stopped is charged for the seconds it was up
(until the guard's exit.json, read where the server ran, else until the meter saw it gone: never
less than it used). An endpoint with no request running or finished for ``idle_s`` (read from
vLLM's /metrics) is stopped too.

Run as ``python -m workbench.serve.metering``, it is the keeper of this WORKBENCH_HOME's wallet
(:mod:`workbench.runs.wallet`): one process at a time (a lock), ticking while any endpoint holds
from the wallet, started by :func:`workbench.serve.deploy` and by ``workbench credit``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.errors import DeployError, EndpointNotFoundError, InsufficientCreditError, WorkbenchError
from workbench.runs.ledger import Ledger, RunHold, to_minor
from workbench.runs.wallet import (
    OWNER,
    Wallet,
    deploy_under_way,
    ensure_keeper,
    keeper_lock,
    release_taker,
)
from workbench.serve.endpoint import (
    CREDIT_FILE,
    LIVE_STATES,
    STOP_FILE,
    get_endpoint,
    refresh_state,
)

RENEW_AHEAD_S = 30.0  # the next block is held this long (at most half a block) before one ends
TICK_S = 2.0  # how often the wallet's keeper ticks


class RegistryWatch:
    """How a meter sees and stops the endpoints of this WORKBENCH_HOME's registry: the ones this
    user deployed (a wallet's, a course's on a remote serve target)."""

    def ended_at(self, name: str) -> float | None:
        return ended_at(name)

    def requests_seen(self, name: str) -> tuple[float, float] | None:
        return requests_seen(name)

    def stop(self, name: str, why: str) -> None:
        """Stop it, its reason written first (whoever sees it stopped reads why); raises
        DeployError when its processes outlive the stop."""
        try:
            ep = get_endpoint(name)
            (ep.dir / STOP_FILE).write_text(json.dumps({"reason": why, "time": time.time()}))
            ep.stop()
        except EndpointNotFoundError:
            pass


class BlockMeter:
    """Meters every open endpoint hold of ``account`` (None: every account) in ``ledger``.
    ``starting(hold)``: its deploy is still under way (its own call settles what it held if
    it fails). ``watch`` sees and stops the endpoints (:class:`RegistryWatch` by default; a
    course passes its own for endpoints its students run)."""

    def __init__(self, ledger: Ledger, block_s: float, idle_s: float, actor: str,
                 account: str | None = None,
                 starting: Callable[[RunHold], bool] = lambda h: False,
                 watch: Any = None) -> None:
        self.ledger, self.block_s, self.idle_s, self.actor = ledger, block_s, idle_s, actor
        self.account, self.starting = account, starting
        self.watch = watch or RegistryWatch()
        self._seen: dict[str, tuple[float | None, float]] = {}  # name -> (done, last change)

    def used(self, h: RunHold, until: float) -> int:
        """What ``h``'s block cost up to ``until``: whole minor units, up, at most its hold."""
        seconds = max(0.0, until - float(h.since or h.at))
        return min(h.amount, to_minor(h.amount * seconds / self.block_s, 1))

    def open_blocks(self) -> dict[str, list[RunHold]]:
        """Each metered endpoint's open blocks, oldest first."""
        by_name: dict[str, list[RunHold]] = {}
        for h in self.ledger.holds(self.account, open_only=True):
            if h.kind == "endpoint" and h.run_id:
                by_name.setdefault(h.run_id, []).append(h)
        for holds in by_name.values():
            holds.sort(key=lambda h: float(h.since or h.at))
        return by_name

    def tick(self, now: float | None = None) -> list[str]:
        """Settle passed blocks, hold next ones, stop endpoints out of credit, idle or gone;
        the names of endpoints stopped or found ended."""
        ended = []
        now = time.time() if now is None else now
        renew = min(RENEW_AHEAD_S, self.block_s / 2)
        for name, holds in self.open_blocks().items():
            # A deploy under way is paid block by block too, but only its own call may judge
            # that it failed (it is not registered yet) or idles.
            starting = any(self.starting(h) for h in holds)
            gone_at = None if starting else self.watch.ended_at(name)
            if gone_at is not None:
                for h in holds:
                    self.ledger.settle(h.hold_id, self.used(h, gone_at), actor=self.actor,
                                       note=f"endpoint {name} ended")
                ended.append(name)
                continue
            for h in holds[:-1]:
                if now >= float(h.since or h.at) + self.block_s:
                    self.ledger.settle(h.hold_id, h.amount, actor=self.actor,
                                       note=f"endpoint {name}: block used")
            current = holds[-1]
            block_end = float(current.since or current.at) + self.block_s
            if now >= block_end - renew:
                try:
                    hold_id = self.ledger.hold(current.student, current.amount,
                                               actor=self.actor, note=f"endpoint {name}")
                except InsufficientCreditError:
                    if self._stop_or_retry(name, "the credit ran out", at=now):
                        ended.append(name)
                    continue
                self.ledger.attach_run(hold_id, name, str(current.run_dir), kind="endpoint",
                                       since=block_end)
            idle = 0.0 if starting else self._idle_s(name, now)
            if idle > self.idle_s and self._stop_or_retry(
                    name, f"idle for {idle / 60:.1f} min", at=now):
                ended.append(name)
        return ended

    def _stop_or_retry(self, name: str, why: str, at: float) -> bool:
        """:meth:`stop` from the meter: whether it stopped. An endpoint whose processes outlive
        the stop (or whose machine cannot say) keeps its holds open, and the next tick tries
        again, rather than ending the tick of every other endpoint."""
        try:
            self.stop(name, why, at=at)
        except DeployError:
            return False
        return True

    def stop(self, name: str, why: str, at: float | None = None) -> None:
        """Stop the endpoint and settle every open block of it for the time it was up."""
        self.watch.stop(name, why)
        # Charged until its processes were gone (the guard's exit, or when the watch saw none),
        # not until the stop was asked: a server takes seconds to end.
        gone = self.watch.ended_at(name)
        stopped = max(time.time() if gone is None else gone, at or 0.0)
        for h in self.open_blocks().get(name, []):  # read again: one held this tick is among them
            self.ledger.settle(h.hold_id, self.used(h, stopped), actor=self.actor,
                               note=f"endpoint {name} stopped: {why}")

    def _idle_s(self, name: str, now: float) -> float:
        """Seconds since a request last ran on the endpoint, as far as this meter has seen
        (after a restart of the meter, idle time counts again from its first look)."""
        last_done, last_change = self._seen.get(name, (None, now))
        reading = self.watch.requests_seen(name)
        if reading is not None:
            done, running = reading
            if running or (last_done is not None and done != last_done):
                last_change = now
            last_done = done
        self._seen[name] = (last_done, last_change)
        return now - last_change


def stopped_because(endpoint_dir: str | Path) -> str | None:
    try:
        return str(json.loads((Path(endpoint_dir) / STOP_FILE).read_text())["reason"])
    except (OSError, ValueError, KeyError):
        return None


def ended_at(name: str) -> float | None:
    """When the endpoint stopped, if it has; None while it is up. The time is the one in its
    guard's exit.json, read where the server ran; now (when the meter saw it gone) if that
    cannot be read."""
    from workbench.serve.remote import close_tunnel
    from workbench.serve.targets import get_serve_target

    try:
        record = refresh_state(name)
    except EndpointNotFoundError:
        return time.time()  # never registered: its deploy died
    if record.state in LIVE_STATES:
        return None
    close_tunnel(record.endpoint_dir)  # the meter's own tunnel to it, if one was opened
    try:
        exit_info = json.loads(get_serve_target(record.target).read(record, "exit.json"))
        return float(exit_info["time"])
    except (WorkbenchError, ValueError, KeyError, TypeError):
        return time.time()


def requests_seen(name: str) -> tuple[float, float] | None:
    """(requests finished, requests running) of a registered endpoint, reached through its serve
    target (an SSH tunnel, a Slurm node's address); None: no reading (starting, stopped or not
    answering)."""
    try:
        ep = get_endpoint(name)
        url, headers = ep.url, ep._headers()
    except Exception:
        return None
    return read_requests(url, headers)


def read_requests(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """(requests finished, requests running) from the vLLM server at ``url``'s Prometheus
    /metrics; None when it does not answer."""
    try:
        req = urllib.request.Request(f"{url}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=3) as resp:
            text = resp.read().decode("utf-8", "replace")
    except Exception:
        return None
    done = running = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            done += float(line.rsplit(" ", 1)[-1])
        elif line.startswith("vllm:num_requests_running"):
            running += float(line.rsplit(" ", 1)[-1])
    return done, running


# -- the wallet's keeper ------------------------------------------------------------------------
def hold_first_block(spec: Any, name: str, endpoint_dir: Path) -> tuple[Wallet, int] | None:
    """Before an endpoint starts: hold its first block from the wallet, if one is set and the
    endpoint has a price (``endpoint_price_per_hour`` in the wallet's settings, else the run's
    hourly price on its target). (wallet, hold) or None; a short wallet refuses, nothing starts."""
    from workbench.errors import CreditError
    from workbench.runs.budget import hourly_price

    wallet = Wallet.open()
    if wallet is None:
        return None
    price = wallet.settings.get("endpoint_price_per_hour")
    if price is None and spec is not None:
        price, currency = hourly_price(spec)
        if price and currency != wallet.currency:
            raise CreditError(f"endpoint {name} is priced in {currency} but the wallet is in "
                              f"{wallet.currency}; set the wallet's endpoint_price_per_hour")
    if not price:
        return None
    block_s = float(wallet.settings["endpoint_hold_minutes"]) * 60
    hold_id = wallet.hold(wallet.minor(float(price) * block_s / 3600),
                          f"endpoint {name} ({price:g} {wallet.currency}/h)")
    # Its taker (this process) is kept on record until the endpoint is up: the keeper leaves a
    # block whose deploy is under way alone.
    wallet.ledger.attach_run(hold_id, name, str(endpoint_dir), kind="endpoint",
                             since=time.time())
    ensure_keeper()  # a slow start is paid block by block as well
    return wallet, hold_id


def settle_start(paid: tuple[Wallet, int], ok: bool) -> None:
    """After a deploy's start: a failed one is charged the seconds it held the block; an
    endpoint that is up is the keeper's from now on (started here unless one runs)."""
    wallet, hold_id = paid
    if not ok:
        hold = next(h for h in wallet.ledger.holds(OWNER) if h.hold_id == hold_id)
        wallet.release(hold_id, wallet_meter(wallet).used(hold, time.time()),
                       "the endpoint did not start")
        return
    release_taker(hold_id)
    ensure_keeper()


def wallet_meter(wallet: Wallet) -> BlockMeter:
    settings = wallet.settings
    return BlockMeter(wallet.ledger, float(settings["endpoint_hold_minutes"]) * 60,
                      float(settings["endpoint_idle_minutes"]) * 60, actor="wallet-keeper",
                      account=OWNER, starting=lambda h: deploy_under_way(h.hold_id))


def write_credit_notes(wallet: Wallet, meter: BlockMeter, now: float) -> None:
    """In each metered endpoint's folder: how many minutes the wallet still covers at its rate,
    and a warning once that is under ``endpoint_warn_minutes``."""
    balance = wallet.account().balance
    warn_s = float(wallet.settings["endpoint_warn_minutes"]) * 60
    for name, holds in meter.open_blocks().items():
        rate = holds[-1].amount / meter.block_s  # minor units a second
        if not rate:
            continue
        paid_until = float(holds[-1].since or holds[-1].at) + meter.block_s
        left_s = max(0.0, paid_until - now) + balance / rate
        note: dict[str, Any] = {"seconds_left": round(left_s), "time": now, "warning": None}
        if left_s < warn_s:
            note["warning"] = (f"the wallet covers about {left_s / 60:.0f} more minute(s) of "
                               f"endpoint {name}; it stops then (`workbench credit add` for more)")
        folder = Path(str(holds[-1].run_dir))
        if folder.is_dir():
            tmp = folder / (CREDIT_FILE + ".tmp")
            tmp.write_text(json.dumps(note))
            tmp.replace(folder / CREDIT_FILE)


def keep_wallet(once: bool = False) -> int:
    """Tick the wallet's endpoints until none holds from it; 0 at once if another keeper runs."""
    import fcntl

    with open(keeper_lock(), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0
        meter = None
        while True:
            wallet = Wallet.open()
            if wallet is None:
                return 0
            meter = meter or wallet_meter(wallet)
            now = time.time()
            for name in meter.tick(now):
                print(f"keeper: endpoint {name} ended", flush=True)
            write_credit_notes(wallet, meter, now)
            if once:
                return 0
            if not meter.open_blocks():
                # Let go first, then look again: a deploy that held its first block meanwhile
                # found the lock taken and started no keeper, so this one goes on for it.
                fcntl.flock(lock, fcntl.LOCK_UN)
                if not meter.open_blocks():
                    return 0
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return 0  # a new keeper has it
            time.sleep(TICK_S)


if __name__ == "__main__":
    raise SystemExit(keep_wallet())
