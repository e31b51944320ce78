"""One precision decision for planner and trainer (issue 16, item 1).

The resolver's table is written out by hand below from the rules a GPU practitioner uses (fp32
master weights for full fine-tuning, 16-bit frozen base for LoRA, fp16 on cards without bf16,
fp32 on CPU). This machine has no GPU: the trainer's GPU choice is checked by passing the device
kind the resolver would see on one (a parameter, not a patch of torch) and loading the real tiny
model on CPU with it.
"""

from __future__ import annotations

import pytest

from workbench.errors import SpecError
from workbench.plan import plan
from workbench.precision import resolve_precision
from workbench.spec import RunSpec

# (model.dtype, method, device) -> (load dtype, amp, fp32 trained params + Adam)
TABLE = [
    ("auto", "full", "cpu", "float32", "none", True),
    ("auto", "lora", "cpu", "float32", "none", True),
    ("bfloat16", "lora", "cpu", "bfloat16", "none", True),
    ("bfloat16", "full", "cpu", "float32", "none", True),  # never pure 16-bit full FT
    ("auto", "full", "cuda-bf16", "float32", "bf16", True),  # A100/H100: fp32 master + autocast
    ("bfloat16", "full", "cuda-bf16", "float32", "bf16", True),
    ("auto", "lora", "cuda-bf16", "bfloat16", "bf16", True),
    ("auto", "qlora", "cuda-bf16", "bfloat16", "bf16", True),
    ("float16", "lora", "cuda-bf16", "float16", "fp16", True),
    ("float32", "full", "cuda-bf16", "float32", "none", True),
    ("auto", "full", "cuda-fp16", "float32", "fp16", True),  # V100/T4: fp16 AMP, fp32 master
    ("auto", "lora", "cuda-fp16", "float16", "fp16", True),
    ("auto", "qlora", "cuda-fp16", "float16", "fp16", True),
    ("float32", "lora", "cuda-fp16", "float32", "none", True),
]


@pytest.mark.parametrize(("dtype", "method", "device", "load", "amp", "fp32"), TABLE)
def test_resolver_table(dtype, method, device, load, amp, fp32):
    p = resolve_precision(dtype, method, device)
    assert (p.load_dtype, p.amp, p.fp32_trainable) == (load, amp, fp32)
    assert p.reason and "\n" not in p.reason


def test_bf16_on_a_card_without_it_is_a_spec_error_that_says_what_to_set():
    with pytest.raises(SpecError, match="model.dtype: auto or float16"):
        resolve_precision("bfloat16", "lora", "cuda-fp16")
    spec = RunSpec.parse({"model": {"dtype": "bfloat16"},
                          "resources": {"gpus_per_node": 1, "gpu_type": "T4"},
                          "train": {"max_steps": 10}})
    with pytest.raises(SpecError, match="no bf16"):
        plan(spec)


def _gpu_spec(kind: str, gpu: str, **model) -> RunSpec:
    return RunSpec.parse({"model": {"id": "builtin:tiny-llama", **model}, "method": {"kind": kind},
                          "resources": {"gpus_per_node": 1, "gpu_type": gpu},
                          "parallel": {"strategy": "ddp"}, "train": {"max_steps": 10}})


def test_full_fine_tuning_on_an_a100_is_planned_with_fp32_master_weights_and_adam():
    p = plan(_gpu_spec("full", "A100-80G"))
    n = p.params
    m = p.memory
    gib = 2**30
    # ZeRO paper (Rajbhandari et al. 2020, sec. 3.1): mixed-precision Adam holds 16 bytes per
    # parameter of model states: 2 (16-bit weights) + 2 (16-bit grads) + 4 (fp32 master copy)
    # + 4 + 4 (fp32 Adam moments). torch AMP over fp32 parameters holds the fp32 weights and
    # fp32 grads instead of the 16-bit ones, plus the 16-bit copies autocast makes: >= 16 bytes.
    # Pure bf16 training (the old trainer) would be 2 + 2 + 2 + 2 = 8 bytes.
    assert m.optimizer * gib == pytest.approx(8 * n, rel=1e-6)  # two fp32 moments
    assert m.weights * gib >= 4 * n  # the fp32 master weights are there
    assert m.gradients * gib == pytest.approx(4 * n, rel=1e-6)  # fp32 gradients of fp32 params
    assert m.model_states * gib >= 16 * n
    assert any("fp32 master" in a and "bf16" in a for a in p.assumptions), p.assumptions


def test_v100_lora_is_planned_and_stated_in_fp16():
    p = plan(_gpu_spec("lora", "V100"))
    # The frozen base in fp16: 2 bytes per weight; the plan says fp16, not bf16.
    assert p.memory.weights * 2**30 == pytest.approx(2 * p.params, rel=1e-6)
    line = next(a for a in p.assumptions if a.startswith("precision:"))
    assert "fp16" in line and "bf16 GPU" not in line


def test_cpu_plan_sizes_fp32_weights():
    p = plan(RunSpec.parse({"method": {"kind": "lora"}, "train": {"max_steps": 10}}))
    assert p.memory.weights * 2**30 == pytest.approx(4 * p.params, rel=1e-6)
    line = next(a for a in p.assumptions if a.startswith("precision:"))
    assert "fp32" in line and "bf16" not in line


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_trainer_loads_what_the_resolver_says_for_a_bf16_gpu(kind, tiny_model):
    """The GPU is faked only by the device kind given to the resolver; the model load is real."""
    import torch

    from workbench.train.run import load_model

    spec = RunSpec.parse({"model": {"id": "builtin:tiny-llama"}, "method": {"kind": kind}})
    model = load_model(spec, str(tiny_model), resolve_precision("auto", kind, "cuda-bf16"))
    params = dict(model.named_parameters())
    trained = {n: p.dtype for n, p in params.items() if p.requires_grad}
    frozen = {n: p.dtype for n, p in params.items() if not p.requires_grad}
    assert trained and set(trained.values()) == {torch.float32}
    if kind == "full":
        assert not frozen
    else:
        assert all("lora_" in n for n in trained)
        assert set(frozen.values()) == {torch.bfloat16}

