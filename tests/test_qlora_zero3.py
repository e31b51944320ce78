"""QLoRA with ZeRO-3 is refused by the planner, with the reason (issue 16, item 2): bitsandbytes
4-bit weights are placed whole on each GPU, and transformers skips ZeRO-3's partitioned load for
quantised models, so such a run would not shard at all. Planning needs no GPU."""

from __future__ import annotations

import pytest

from workbench.errors import PlanError
from workbench.plan import check_fits, plan
from workbench.spec import RunSpec

LLAMA2_7B = "meta-llama/Llama-2-7b-hf"  # its config ships with the planner: no hub access


def _spec(strategy: str, gpus: int = 2) -> RunSpec:
    return RunSpec.parse({"model": {"id": LLAMA2_7B}, "method": {"kind": "qlora"},
                          "resources": {"gpus_per_node": gpus, "gpu_type": "A100-80G"},
                          "parallel": {"strategy": strategy}, "train": {"max_steps": 10}})


def test_qlora_with_zero3_is_refused_with_the_reason_and_a_fix():
    p = plan(_spec("zero3"))
    assert not p.fits  # 7B in 4 bits would fit an A100 many times over: refused for the reason
    with pytest.raises(PlanError, match="QLoRA cannot use ZeRO-3.*zero2 or auto") as err:
        check_fits(p)
    assert "parallel.strategy" in str(err.value)
    assert any(s.changes.get("parallel.strategy") not in (None, "zero3") for s in p.suggestions)


def test_auto_never_picks_zero3_for_qlora():
    for gpus in (1, 2, 8):
        p = plan(_spec("auto", gpus))
        assert p.fits and p.strategy.parallel != "zero3"
        qlora_zero3 = [c for c in p.candidates
                       if c.strategy.method == "qlora" and c.strategy.parallel == "zero3"]
        assert qlora_zero3 and not any(c.fits for c in qlora_zero3)  # evaluated, refused
