"""The plan's price is the bill's price: one rule (workbench.runs.budget.unit_price) for both.

Two copies of the pricing rule drifted apart once already (the planner worked out its own price per
device); these cases hold them together, including the currency and the card a suggestion names.
"""

import pytest

from workbench.plan import plan
from workbench.runs import budget
from workbench.spec import RunSpec

# Each case with its price per hour of the whole run, worked out by hand from docs/planning.md:
# a core-hour price x cores (one per process), the GPU table's list price per card (A100-80G
# 3.75 CNY) x cards, or the user's price per card x cards.
CASES = {
    "cpu, 2 processes at a core-hour price": ({
        "resources": {"gpus_per_node": 0, "processes_per_node": 2},
        "budget": {"price_per_cpu_core_hour": 0.25}}, (0.5, "CNY")),
    "2 A100s from the GPU table": ({
        "resources": {"gpus_per_node": 2, "gpu_type": "A100-80G"}}, (7.5, "CNY")),
    "2 nodes x 4 H100s at a price the user gives": ({
        "resources": {"gpus_per_node": 4, "nodes": 2, "gpu_type": "H100"},
        "budget": {"price_per_gpu_hour": 3.5, "currency": "USD"}}, (28.0, "USD")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_cost_per_hour_equals_the_bills(name):
    fields, (whole_run_per_hour, currency) = CASES[name]
    spec = RunSpec(train={"max_steps": 10}, **fields)
    p = plan(spec)
    assert budget.hourly_price(spec) == (pytest.approx(whole_run_per_hour), currency)
    assert p.currency == currency
    # The plan charges its hours plus start-up and release at the run's hourly price.
    billed_hours = p.hours + p.startup_cost / whole_run_per_hour
    assert p.cost == pytest.approx(billed_hours * whole_run_per_hour, rel=1e-9)
    # And what the bill would charge for those hours, recomputed through budget.cost:
    assert budget.cost(spec, billed_hours * 3600) == pytest.approx(p.cost, rel=1e-9)


def test_a_card_suggestion_is_priced_as_the_bill_would_price_that_card():
    # A limit far below the run's cost: the plan suggests other cards, each with its price.
    spec = RunSpec(train={"max_steps": 2000}, resources={"gpus_per_node": 1, "gpu_type": "A100-80G"},
                   budget={"limit": 0.01})
    p = plan(spec)
    cards = {s.changes["resources.gpu_type"]: s for s in p.suggestions
             if "resources.gpu_type" in s.changes}
    assert cards, [s.text for s in p.suggestions]
    # The GPU table's list prices (docs/planning.md), one card: the bill's price for that card.
    listed = {"A100-80G": 3.75, "A100-40G": 3.6, "H100": 9.9, "RTX 4090": 1.2}
    for card, s in cards.items():
        assert card in listed, s.text  # a card with no price could not keep the limit either
        priced = budget.hourly_price(spec.updated(**s.changes))
        assert priced == (pytest.approx(listed[card]), "CNY"), s.text
