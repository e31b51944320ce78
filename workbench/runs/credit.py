"""``workbench.credit()``: the wallet (:mod:`.wallet`) as its owner sees it, every ended run
settled through its target first, and the meter of its endpoints running.

    >>> workbench.credit(10, "CNY")          # start (or top up to) 10 CNY   # doctest: +SKIP
    >>> workbench.credit()                   # balance, what holds it        # doctest: +SKIP
    balance 7.70 CNY, 2.30 CNY held, 0.00 CNY spent of 10.00 CNY
      held 2.30 CNY by launch qwen-lora-20261204-101500-ab12
"""

from __future__ import annotations

import time
from typing import Any

from workbench.errors import CreditError
from workbench.runs.jobs import get_job
from workbench.runs.wallet import OWNER, Wallet, ensure_keeper


class Credit(Wallet):
    """The wallet with its views: one line of balance, held and spent with what holds it
    (``repr``, the CLI), an HTML table with the history a click away (a notebook), the history
    as text, and the figures as a dict (the lab panel)."""

    def to_dict(self) -> dict[str, Any]:
        a = self.account()
        per = self.minor_per_unit
        return {"currency": self.currency, "balance": a.balance / per, "held": a.held / per,
                "charged": a.charges / per, "credit": (a.credits + a.grants) / per,
                "holds": [{"what": f"{h.kind or 'starting'} {h.run_id or ''}".strip(),
                           "held": h.amount / per, "since": h.at}
                          for h in self.ledger.holds(OWNER, open_only=True)],
                "history": [{"at": e["at"], "kind": e["kind"], "amount": e["amount"] / per,
                             "note": e["note"]} for e in self.ledger.entries(OWNER)],
                "settings": dict(self.settings)}

    def summary(self) -> str:
        a = self.account()
        held = self.ledger.holds(OWNER, open_only=True)
        lines = [f"balance {self.money(a.balance)}"
                 + (f", {self.money(a.held)} held" if a.held else " (nothing held)")
                 + f", {self.money(a.charges)} spent of {self.money(a.credits + a.grants)}"]
        lines += [f"  held {self.money(h.amount)} by {h.kind or 'a starting launch'} "
                  f"{h.run_id or ''}".rstrip() for h in held]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        import html

        rows = "".join(f"<tr><td>{html.escape(line.strip())}</td></tr>"
                       for line in self.summary().splitlines()[1:])
        return (f"<b>Wallet</b>: {html.escape(self.summary().splitlines()[0])}"
                + (f"<table>{rows}</table>" if rows else "")
                + "<details><summary>history</summary><pre>"
                + html.escape(self.history_text()) + "</pre></details>")

    def history_text(self) -> str:
        rows = []
        for e in self.ledger.entries(OWNER):
            if e["kind"] == "release":
                continue  # the charge row beside it says what the hold cost
            sign = "+" if e["kind"] in ("credit", "grant") else "-" if e["kind"] == "charge" else " "
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["at"]))
            rows.append(f"{when}  {e['kind']:<7}{sign}{self.money(e['amount']):>14}  {e['note']}")
        return "\n".join(rows)


def run_status(run_id: str) -> dict[str, Any]:
    """A run's status read through its backend (how a wallet settles what ended)."""
    return get_job(run_id).status()


def credit(amount: float | None = None, currency: str = "CNY", **settings: Any) -> Credit:
    """The wallet of this WORKBENCH_HOME, set to ``amount`` first when given
    (``workbench.credit(10, "CNY")``); its ``settings`` (endpoint_hold_minutes,
    endpoint_idle_minutes, endpoint_warn_minutes, eval_hold_minutes, endpoint_price_per_hour)
    may be given too. Ended work is settled before it is shown."""
    if amount is not None:
        Wallet.create(amount, currency, **settings)
    wallet = Credit.open(status_of=run_status)
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
