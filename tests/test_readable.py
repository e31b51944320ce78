"""job.summary() reads rounded and in units in a notebook, and stays the exact dict in code."""

from __future__ import annotations

from IPython.lib.pretty import pretty

from workbench.runs.readable import Readable


def test_a_summary_shows_rounded_values_in_units_and_keeps_the_exact_ones():
    exact = {"id": "quickstart-1", "state": "succeeded", "last_loss": 1.4837465,
             "elapsed_s": 21.035319089889526, "eta_s": 3725.2, "planned_total_s": 95,
             "projected_total_range_s": [80.123, 130.9], "cost": 0.000123456, "note": None,
             "error": "", "restarts": 0}
    r = Readable(exact)
    assert r == exact and r["elapsed_s"] == 21.035319089889526  # code reads what it read before
    assert pretty(r).splitlines() == [
        "id                       quickstart-1",
        "state                    succeeded",
        "last_loss                1.484",
        "elapsed_s                21.0 s",
        "eta_s                    1h02m",
        "planned_total_s          1m35s",
        "projected_total_range_s  1m20s - 2m11s",
        "cost                     0.0001235",
        "restarts                 0",
    ]
    assert "<td style='text-align:left'>21.0 s</td>" in r._repr_html_()
    assert "note" not in r._repr_html_()  # empty values are left out


def test_a_rate_per_second_is_not_read_as_a_duration():
    # tokens_per_s ends in "_s" as the durations do; 11,700 tokens a second is not "3h15m".
    r = Readable({"tokens_per_s": 11700.4, "elapsed_s": 4.8})
    assert pretty(r).splitlines() == ["tokens_per_s  11,700", "elapsed_s     4.8 s"]
