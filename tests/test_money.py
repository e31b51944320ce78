"""Money reads true, the same in every view (issue 37, item 4): a run that bills nothing reads
"free" (price 0) or "no price set" (price unknown), never a made-up "0.00 CNY"; a priced amount
reads to the cent, "< 0.01" below half a cent. The plan's headline and summary, job.summary() in a
notebook, ``workbench status RUN`` and the lab panel's row all say it the same way."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from IPython.lib.pretty import pretty

from workbench.plan import plan
from workbench.plan.view import headline
from workbench.runs.readable import Readable
from workbench.spec import RunSpec


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _cost_line(p) -> str:
    return next(line for line in p.summary().splitlines() if line.startswith("Cost:"))


def test_a_free_cpu_run_is_planned_as_free_not_as_zero_money():
    p = plan(RunSpec.parse({"train": {"max_steps": 20}}))  # CPU: price per core-hour 0
    assert p.price_per_hour == 0 and p.cost == 0
    assert headline(p).endswith(" · free"), headline(p)
    assert "CNY" not in p._repr_html_()  # no money at all: not "0.00 CNY"
    assert _cost_line(p) == ("Cost: free (the price per core-hour is 0; set "
                             "budget.price_per_cpu_core_hour to price this run)")


def test_a_gpu_run_without_a_price_says_so_in_its_headline():
    p = plan(RunSpec.parse({"model": {"id": "Qwen/Qwen2.5-0.5B"},
                            "resources": {"gpus_per_node": 1, "gpu_type": "H200"},
                            "train": {"max_steps": 20}}))  # the H200 has no list price
    assert p.price_per_hour is None and p.cost is None
    assert headline(p).endswith(" · no price set"), headline(p)
    assert _cost_line(p).startswith("Cost: no price set (the price per GPU-hour is unknown; set "
                                    "budget.price_per_gpu_hour")


def test_a_priced_run_reads_to_the_cent_and_below_a_cent_as_such():
    cheap = plan(RunSpec.parse({"train": {"max_steps": 20},
                                "budget": {"price_per_cpu_core_hour": 0.001}}))
    assert 0 < cheap.cost < 0.005
    assert headline(cheap).endswith(" · < 0.01 CNY"), headline(cheap)
    dear = plan(RunSpec.parse({"train": {"max_steps": 20},
                               "budget": {"price_per_cpu_core_hour": 500.0}}))
    shown = re.search(r" · ([\d,]+\.\d\d) CNY$", headline(dear))
    assert shown and float(shown.group(1).replace(",", "")) == round(dear.cost, 2)
    assert _cost_line(dear).startswith(f"Cost: {dear.cost:,.2f} CNY")


def _summary(price, cost=0.0, planned=0.0, projected=None):
    # The keys job.summary() returns, in its order, with the plan's price per unit-hour.
    return Readable({"id": "r-1", "state": "succeeded", "projected_cost": projected,
                     "projected_cost_range": None, "planned_total_s": 95,
                     "planned_cost": planned, "currency": "CNY", "price_per_hour": price,
                     "cost": cost})


def test_a_summary_shows_free_or_no_price_once_and_a_priced_bill_in_cents():
    assert pretty(_summary(0.0)).splitlines() == [
        "id               r-1", "state            succeeded", "planned_total_s  1m35s",
        "cost             free"]
    assert pretty(_summary(None)).splitlines()[-1] == "cost             no price set"
    priced = _summary(2.6, cost=0.4213, planned=0.0004, projected=0.61)
    assert pretty(priced).splitlines() == [
        "id               r-1", "state            succeeded", "projected_cost   0.61 CNY",
        "planned_total_s  1m35s", "planned_cost     < 0.01 CNY", "cost             0.42 CNY"]
    assert priced["cost"] == 0.4213  # code still reads the exact figure


def test_workbench_status_and_the_panel_row_write_money_as_the_summary_does(monkeypatch):
    from workbench.cli.runs import _status

    free = _summary(0.0)
    job = SimpleNamespace(summary=lambda: free)
    monkeypatch.setattr("workbench.runs.jobs.get_job", lambda run: job)
    out = _status(SimpleNamespace(run="r-1"))
    assert "        cost: free" in out.splitlines()
    assert "0.0" not in out and "CNY" not in out

    from workbench_lab.view import RunsView

    status = {"state": "succeeded", "cost": 0.0, "currency": "CNY"}
    lab_job = SimpleNamespace(
        summary=lambda: free, name="r", metrics=lambda: [],
        record=SimpleNamespace(created=0.0),
        run_dir=SimpleNamespace(status=lambda: status, path="/nowhere",
                                tb_dir=SimpleNamespace(is_dir=lambda: False)))
    row = RunsView("/").row(lab_job)
    assert row["money"] == {"cost": "free"}
    priced = _summary(2.6, cost=0.4213, planned=0.5)
    lab_job.summary = lambda: priced
    assert RunsView("/").row(lab_job)["money"] == {"cost": "0.42 CNY",
                                                   "planned_cost": "0.50 CNY"}
