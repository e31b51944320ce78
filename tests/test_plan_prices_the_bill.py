"""The plan's price is the bill's price: one rule (workbench.runs.budget.unit_price) for both.

Two copies of the pricing rule drifted apart once already (the planner worked out its own price per
device); these cases hold them together, including the currency and the card a suggestion names.
"""

import pytest

from workbench.plan import plan
from workbench.runs import budget
from workbench.spec import RunSpec

CASES = {
    "cpu, 2 processes at a core-hour price": {
        "resources": {"gpus_per_node": 0, "processes_per_node": 2},
        "budget": {"price_per_cpu_core_hour": 0.25}},
    "2 A100s from the GPU table": {
        "resources": {"gpus_per_node": 2, "gpu_type": "A100-80G"}},
    "2 nodes x 4 H100s at a price the user gives": {
        "resources": {"gpus_per_node": 4, "nodes": 2, "gpu_type": "H100"},
        "budget": {"price_per_gpu_hour": 3.5, "currency": "USD"}},
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_cost_per_hour_equals_the_bills(name):
    spec = RunSpec(train={"max_steps": 10}, **CASES[name])
    p = plan(spec)
    whole_run_per_hour, currency = budget.hourly_price(spec)
    assert p.currency == currency
    # The plan charges its hours plus start-up and release at the run's hourly price.
    billed_hours = p.hours + p.startup_cost / whole_run_per_hour
    assert p.cost == pytest.approx(billed_hours * whole_run_per_hour, rel=1e-9)
    # And what the bill would charge for those hours, recomputed through budget.cost:
    assert budget.cost(spec, billed_hours * 3600) == pytest.approx(p.cost, rel=1e-9)


def test_a_card_suggestion_is_priced_as_the_bill_would_price_that_card():
    # H200 has no price in the table: a limit cannot be kept, so the plan suggests priced cards.
    spec = RunSpec(train={"max_steps": 2000}, resources={"gpus_per_node": 1, "gpu_type": "A100-80G"},
                   budget={"limit": 0.01})
    p = plan(spec)
    for s in p.suggestions:
        card = s.changes.get("resources.gpu_type")
        if card:
            priced = budget.hourly_price(spec.updated(**s.changes))[0]
            assert priced > 0, s.text
