"""The optimizer a run steps (``train.optimizer``): AdamW or bitsandbytes' 8-bit / paged 8-bit
AdamW, after backward or inside it (``train.optimizer_in_backward``, with bf16 weights:
``train.master_weights``), planned as the trainer will run it. Plans are made offline (Qwen2.5 shapes from the
offline table) for a 24 GB RTX 4090; the trainer's side is the resolver it calls
(workbench.train.fastpath) and the choice it reads back from plan.json."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from workbench.errors import FastPathError
from workbench.plan import Strategy, estimate_memory, model_shape, plan
from workbench.plan.inputs import _setup
from workbench.spec import RunSpec
from workbench.spec.sections import FastSpec
from workbench.train.fastpath import Device, resolve_fast_paths

Q15, Q05 = "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-0.5B"


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _spec(model: str, optimizer: str = "auto", gpus: int = 1, **parallel) -> RunSpec:
    return RunSpec.parse({
        "model": {"id": model}, "method": {"kind": "full"},
        "train": {"batch_size": 1, "gradient_checkpointing": True, "max_steps": 10,
                  "optimizer": optimizer},
        "data": {"max_length": 512, "packing": True},
        "resources": {"gpus_per_node": gpus, "gpu_type": "RTX 4090" if gpus else None},
        "parallel": parallel or {"strategy": "auto"}})


def test_a_24gb_card_that_only_fits_with_the_8bit_optimizer_picks_it_before_offload():
    # Full fine-tuning of 1.5B: AdamW's 18 B per parameter (fp32 weights, gradients, moments and
    # the autocast copies) are ~28 GiB; 8-bit moments, paged, leave ~16 GiB on the card.
    p = plan(_spec(Q15))
    assert p.fits and p.strategy == Strategy("full", "ddp", optimizer="paged_adamw_8bit"), \
        p.summary()
    plain = next(c for c in p.candidates if c.strategy == Strategy("full", "ddp"))
    assert not plain.fits
    offload = next(c for c in p.candidates
                   if c.strategy == Strategy("full", "zero2", offload_optimizer=True))
    assert offload.fits and offload.hours > p.hours  # fits too, but is reached for later
    assert "paged 8-bit adamw" in p.summary()
    assert p.memory.paged == pytest.approx(2.03 * p.params / 2**30, rel=0.01)
    assert any("they fit in the card's free memory" in r for r in p.reasons), p.reasons


def test_a_run_that_fits_with_adamw_keeps_adamw():
    p = plan(_spec(Q05))
    assert p.fits and p.strategy == Strategy("full", "ddp"), p.summary()
    eight = next(c for c in p.candidates if c.strategy.optimizer == "paged_adamw_8bit")
    assert eight.fits and eight.hours <= p.hours  # faster, yet AdamW's exact states come first


def test_train_optimizer_adamw_is_never_swapped_for_the_8bit_one():
    # Not fitting with fp32 master weights, AdamW is stepped in backward over bf16 weights
    # before its states are offloaded; either way it stays AdamW.
    p = plan(_spec(Q15, "adamw"))
    assert p.strategy == Strategy("full", "ddp", in_backward=True, weights_16bit=True), \
        p.summary()
    assert all(c.strategy.optimizer == "adamw" for c in p.candidates)


def test_an_explicit_8bit_optimizer_is_planned_with_its_smaller_states():
    p = plan(_spec(Q05, "adamw_8bit", strategy="ddp"))
    assert p.strategy.optimizer == "adamw_8bit" and p.memory.paged == 0.0
    adamw = plan(_spec(Q05, "adamw", strategy="ddp"))
    # Two 1-byte moments and an fp32 absmax per 256 values of each, against two fp32 moments.
    assert p.memory.optimizer == pytest.approx(adamw.memory.optimizer * (2 + 8 / 256) / 8)
    assert p.clock["step_s"] < adamw.clock["step_s"]  # 16 bytes streamed per update, not 28


def test_a_paged_optimizer_that_outgrows_the_card_is_charged_for_the_pages_it_moves():
    shape = model_shape(Q15)
    s = _setup(_spec(Q15), shape, True, 512)
    on_card = estimate_memory(s, Strategy("full", "ddp", optimizer="adamw_8bit"))
    paged = estimate_memory(s, Strategy("full", "ddp", optimizer="paged_adamw_8bit"))
    assert paged.total == pytest.approx(on_card.total - on_card.optimizer * 1.05, rel=1e-6)
    assert paged.paged == pytest.approx(on_card.optimizer)
    from workbench.plan.memory import paged_spill_gib
    from workbench.plan.timing import paging_seconds

    assert paged_spill_gib(paged, paged.total + paged.paged) == 0.0
    assert paged_spill_gib(paged, paged.total + 1.0) == pytest.approx(paged.paged - 1.0)
    assert paging_seconds(16 * 1e9 / 2**30) == pytest.approx(1.0)  # PCIe 4.0 x16, full duplex


def test_the_8bit_optimizer_on_a_cpu_run_is_refused_when_planned():
    with pytest.raises(FastPathError, match="need a CUDA GPU"):
        plan(_spec(Q05, "paged_adamw_8bit", gpus=0, strategy="ddp"))


def test_the_8bit_optimizer_where_bitsandbytes_is_missing_is_refused_when_planned(monkeypatch):
    """Planned for this machine (target local, a CUDA card visible, bitsandbytes absent): the
    plan, which launch makes first, refuses it with the fix; ``auto`` falls back to offload."""
    from workbench.plan import paths
    from workbench.train import fastpath

    real = importlib.util.find_spec
    monkeypatch.setattr(paths, "_cuda_here", lambda: True)
    monkeypatch.setattr(fastpath.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(FastPathError, match="bitsandbytes is not installed"):
        plan(_spec(Q15, "paged_adamw_8bit", strategy="ddp"))
    p = plan(_spec(Q15))
    assert p.strategy == Strategy("full", "ddp", in_backward=True, weights_16bit=True), \
        p.summary()


def test_the_8bit_optimizer_under_deepspeed_is_refused():
    with pytest.raises(FastPathError, match="DeepSpeed ZeRO steps its own optimizer"):
        plan(_spec(Q05, "paged_adamw_8bit", strategy="zero2"))


@pytest.mark.parametrize(("optimizer", "optim"), [("adamw_8bit", "adamw_bnb_8bit"),
                                                  ("paged_adamw_8bit", "paged_adamw_8bit")])
def test_the_trainer_is_given_the_bitsandbytes_optimizer(optimizer, optim):
    fast = resolve_fast_paths(FastSpec(), Device(cuda=True, capability=(8, 9), bitsandbytes=True),
                              "llama", "float32", optimizer=optimizer)
    assert fast.training_kwargs()["optim"] == optim
    assert "8-bit adamw" in fast.line()
    with pytest.raises(FastPathError, match="pip install bitsandbytes"):
        resolve_fast_paths(FastSpec(), Device(cuda=True, capability=(8, 9)), "llama", "float32",
                           optimizer=optimizer)


def test_the_trainer_reads_the_planned_optimizer_from_plan_json(tmp_path):
    from workbench.train.strategy import resolved_optimizer

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"strategy": {"parallel": "ddp",
                                                  "optimizer": "paged_adamw_8bit"}}))
    rd = SimpleNamespace(plan_file=plan_file)
    assert resolved_optimizer(_spec(Q15), rd) == "paged_adamw_8bit"  # type: ignore[arg-type]
    assert resolved_optimizer(_spec(Q15, "adamw_8bit"), rd) == "adamw_8bit"  # type: ignore[arg-type]
    assert resolved_optimizer(_spec(Q15, strategy="ddp"), rd) == "adamw"  # type: ignore[arg-type]


def _in_backward(spec: RunSpec) -> list[Strategy]:
    return [c.strategy for c in plan(spec).candidates if c.strategy.in_backward]


def test_the_optimizer_in_backward_frees_the_gradients_and_the_fp32_masters():
    """1.5B on a 24 GB card with AdamW: bf16 weights (2 B) where fp32 ones were (4 B, plus their
    2 B autocast copies), the largest parameter's gradient alone where every one was."""
    shape = model_shape(Q15)
    s = _setup(_spec(Q15), shape, True, 512)
    before = estimate_memory(s, Strategy("full", "ddp"))
    after = estimate_memory(s, Strategy("full", "ddp", in_backward=True, weights_16bit=True))
    gib = 2**30
    assert before.weights * gib == pytest.approx(6 * shape.params)
    assert after.weights * gib == pytest.approx(2 * shape.params)
    assert after.gradients * gib == pytest.approx(2 * shape.largest_layer_params)
    assert after.optimizer == pytest.approx(before.optimizer)  # AdamW's moments stay fp32


def test_auto_reaches_for_the_optimizer_in_backward_only_on_one_bf16_card():
    assert _in_backward(_spec(Q15))  # a candidate on one RTX 4090 ...
    assert not _in_backward(_spec(Q15, gpus=2))  # ... not across two (DDP averages after it)
    assert not _in_backward(_spec(Q15, strategy="ddp"))  # nor under an explicit strategy
    t4 = _spec(Q05).updated(**{"resources.gpu_type": "T4"})
    assert not _in_backward(t4)  # fp16's loss scaler unscales only before step()
    from workbench.plan.inputs import steppings_of

    # CPU plans are as they were: stepped after backward, fp32 weights.
    assert steppings_of(_spec(Q05, gpus=0, strategy="ddp"), False) == ((False, False),)


def test_an_explicit_optimizer_in_backward_is_planned_or_refused_where_it_cannot_run():
    from workbench.errors import SpecError

    p = plan(_spec(Q05).updated(**{"train.optimizer_in_backward": True,
                                   "train.master_weights": "fp32"}))
    assert p.strategy == Strategy("full", "ddp", in_backward=True), p.summary()
    assert all(c.strategy.in_backward for c in p.candidates if c.strategy.method == "full")
    assert "optimizer in backward: each parameter is stepped" in " ".join(p.reasons)
    t4 = _spec(Q05).updated(**{"resources.gpu_type": "T4", "train.optimizer_in_backward": True})
    with pytest.raises(SpecError, match="train.optimizer_in_backward: false"):
        plan(t4)


def test_the_trainer_reads_the_planned_optimizer_in_backward_from_plan_json(tmp_path):
    from workbench.train.strategy import resolved_in_backward

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"strategy": {"parallel": "ddp", "in_backward": True}}))
    rd = SimpleNamespace(plan_file=plan_file)
    assert resolved_in_backward(_spec(Q15), rd) is True  # type: ignore[arg-type]
    explicit = _spec(Q15).updated(**{"train.optimizer_in_backward": False})
    assert resolved_in_backward(explicit, rd) is False  # type: ignore[arg-type]
    assert resolved_in_backward(_spec(Q15, strategy="ddp"), rd) is False  # type: ignore[arg-type]
