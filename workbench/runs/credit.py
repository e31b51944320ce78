"""``workbench.credit()``: the wallet (:mod:`.wallet`) as its owner sees it, every ended run
settled through its target first, and the meter of its endpoints running.

    >>> workbench.credit(10, "CNY")          # start (or top up to) 10 CNY   # doctest: +SKIP
    >>> workbench.credit()                   # balance, what holds it        # doctest: +SKIP
    balance 7.70 CNY, 2.30 CNY held, 0.00 CNY spent of 10.00 CNY
      held 2.30 CNY by launch qwen-lora-20261204-101500-ab12
"""

from __future__ import annotations

from typing import Any

from workbench.errors import CreditError
from workbench.runs.jobs import get_job
from workbench.runs.wallet import OWNER, Wallet, ensure_keeper


def run_status(run_id: str) -> dict[str, Any]:
    """A run's status read through its backend (how a wallet settles what ended)."""
    return get_job(run_id).status()


def credit(amount: float | None = None, currency: str = "CNY", **settings: Any) -> Wallet:
    """The wallet of this WORKBENCH_HOME, set to ``amount`` first when given
    (``workbench.credit(10, "CNY")``); its ``settings`` (endpoint_hold_minutes,
    endpoint_idle_minutes, endpoint_warn_minutes, eval_hold_minutes, endpoint_price_per_hour)
    may be given too. Ended work is settled before it is shown."""
    if amount is not None:
        Wallet.create(amount, currency, **settings)
    wallet = Wallet.open(status_of=run_status)
    if wallet is None:
        raise CreditError("no wallet is set in this WORKBENCH_HOME; set one with "
                          "workbench.credit(AMOUNT, CURRENCY) or `workbench credit set "
                          "AMOUNT CURRENCY`")
    if amount is None:
        wallet.configure(**settings)
    wallet.settle_ended()
    if any(h.kind == "endpoint" for h in wallet.ledger.holds(OWNER, open_only=True)):
        ensure_keeper()  # endpoints hold from it: their meter runs (again, if it was killed)
    return wallet
