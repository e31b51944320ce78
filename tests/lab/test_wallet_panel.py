"""The wallet in the Workbench panel, in a real JupyterLab and a real Chromium: the header line
says what is left, held and spent, the holds and the history open with a click, and the REST
reply carries the same figures.

The lab here has a wallet of its own (WORKBENCH_WALLET names a folder), so the session's other
lab and runs draw from none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

import workbench
from workbench.runs.wallet import Wallet

from .browser import browser_page, open_lab, shot
from .conftest import running_lab


@pytest.fixture
def wallet_lab(wb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "wallet"
    monkeypatch.setenv("WORKBENCH_WALLET", str(folder))
    with running_lab(wb_home, tmp_path / "state", "jupyter-wallet.log",
                     env={"WORKBENCH_WALLET": str(folder)}) as server:
        yield server


def test_the_panel_shows_the_wallet_and_what_holds_it(wallet_lab) -> None:
    workbench.credit(10, "CNY")
    wallet = Wallet.open()
    assert wallet is not None
    hold = wallet.hold(250, "a deploy being started")  # this process is its taker: it stays
    wallet.ledger.attach_run(hold, "panel-ep", str(wallet_lab.root), kind="endpoint")
    reply = requests.get(f"{wallet_lab.url}/workbench/api/runs", headers=wallet_lab.auth,
                         timeout=60).json()["wallet"]
    assert (reply["balance"], reply["held"], reply["charged"], reply["credit"]) == \
        (7.5, 2.5, 0.0, 10.0)
    with browser_page() as page:
        open_lab(page, wallet_lab)
        page.locator(".jp-SideBar [data-id='workbench-runs']").click()
        summary = page.locator(".jp-WorkbenchRuns-wallet > summary")
        summary.wait_for(timeout=30_000)
        assert summary.inner_text() == \
            "Credit 7.50 CNY left · 2.50 CNY held · 0.00 CNY spent of 10.00 CNY"
        summary.click()
        details = page.locator(".jp-WorkbenchRuns-wallet > pre")
        assert "held 2.50 CNY by endpoint panel-ep" in details.inner_text()
        assert "credit  10.00 CNY  starting credit" in details.inner_text()
        shot(page, "wallet-panel")
    wallet.release(hold, 0, "test over")
