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
from workbench.spec import RunSpec
from workbench.spec.precision import resolve_precision

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

    from workbench.train.model import load_model

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



# -- fast paths (workbench.train.fastpath) ---------------------------------------------------
# No GPU here: a GPU is described to the resolver by a hand-written Device (compute capability,
# what is installed), never by patching torch. The expected choices below are written from what
# each kernel needs: Liger = CUDA + liger-kernel + a model type it patches; flash-attention 2 =
# CUDA, Ampere+ (8.0), 16-bit weights, flash-attn installed; fused AdamW = CUDA unless DeepSpeed
# steps an offloaded optimizer; TF32 = Ampere+.

from workbench.errors import FastPathError  # noqa: E402
from workbench.spec import FastSpec  # noqa: E402
from workbench.train.fastpath import Device, resolve_fast_paths  # noqa: E402

H100_ALL = Device(cuda=True, capability=(9, 0), liger=True,
                  liger_types=frozenset({"llama", "qwen2", "mistral"}), flash_attn=True)
H100_BARE = Device(cuda=True, capability=(9, 0))
T4_ALL = Device(cuda=True, capability=(7, 5), liger=True, liger_types=frozenset({"llama"}),
                flash_attn=True)
CPU = Device(cuda=False)

# (device, model type, load dtype, kwargs) -> (liger, attention, optim, tf32)
FAST_TABLE = [
    (CPU, "llama", "float32", {}, (False, None, "adamw_torch", None)),
    (CPU, "llama", "bfloat16", {}, (False, None, "adamw_torch", None)),
    (H100_ALL, "llama", "bfloat16", {}, (True, "flash_attention_2", "adamw_torch_fused", True)),
    # full fine-tuning loads fp32 master weights: no flash-attention 2 (no fp32 kernels)
    (H100_ALL, "llama", "float32", {}, (True, None, "adamw_torch_fused", True)),
    (H100_BARE, "llama", "bfloat16", {}, (False, None, "adamw_torch_fused", True)),
    (H100_ALL, "gpt2", "bfloat16", {}, (False, "flash_attention_2", "adamw_torch_fused", True)),
    (T4_ALL, "llama", "float16", {}, (True, None, "adamw_torch_fused", None)),
    (H100_ALL, "llama", "bfloat16", {"offload_optimizer": True},
     (True, "flash_attention_2", "adamw_torch", True)),
    (H100_ALL, "llama", "bfloat16", {"stage": "dpo"},
     (False, "flash_attention_2", "adamw_torch_fused", True)),
]


@pytest.mark.parametrize(("device", "model_type", "load", "kw", "expected"), FAST_TABLE)
def test_fast_path_resolver_table(device, model_type, load, kw, expected):
    fp = resolve_fast_paths(FastSpec(), device, model_type, load, **kw)
    assert (fp.liger, fp.attention, fp.optim, fp.tf32) == expected
    assert len(fp.notes) == 4 and all(n and "\n" not in n for n in fp.notes)


def test_on_cpu_nothing_cuda_only_reaches_the_trainer_or_the_model():
    fp = resolve_fast_paths(FastSpec(), CPU, "llama", "float32")
    args = fp.training_kwargs()
    assert args["use_liger_kernel"] is False and args["optim"] == "adamw_torch"
    assert "tf32" not in args and "liger_kernel_config" not in args
    assert fp.model_kwargs() == {}  # transformers' own attention choice
    assert fp.line() == "fast paths: liger off, attention default, adamw, tf32 off"


def test_zero3_keeps_liger_but_not_its_fused_loss():
    # The fused linear cross-entropy reads lm_head.weight directly; ZeRO-3 leaves an empty shard.
    fp = resolve_fast_paths(FastSpec(), H100_ALL, "llama", "bfloat16", zero_stage=3)
    assert fp.liger and fp.training_kwargs()["liger_kernel_config"] == {
        "fused_linear_cross_entropy": False}
    assert fp.line().startswith("fast paths: liger on (no fused loss), flash_attention_2")


def test_fast_off_and_per_switch_overrides():
    off = resolve_fast_paths(RunSpec.parse({"train": {"fast": "off"}}).train.fast, H100_ALL,
                             "llama", "bfloat16")
    assert (off.liger, off.attention, off.optim, off.tf32) == (False, None, "adamw_torch", False)
    eager = resolve_fast_paths(FastSpec(attention="eager", liger="off"), H100_ALL, "llama",
                               "bfloat16")
    assert (eager.liger, eager.attention) == (False, "eager")
    spec = RunSpec.parse({"train": {"fast": {"tf32": "off"}}})
    assert RunSpec.from_yaml(spec.to_yaml()).train.fast.tf32 == "off"
    with pytest.raises(SpecError, match="train.fast"):
        RunSpec.parse({"train": {"fast": {"liger": "yes"}}})


@pytest.mark.parametrize(("fast", "device", "model_type", "says"), [
    (FastSpec(liger="on"), CPU, "llama", "CUDA GPU"),
    (FastSpec(liger="on"), H100_BARE, "llama", "workbench[gpu]"),
    (FastSpec(liger="on"), H100_ALL, "gpt2", "'gpt2'"),
    (FastSpec(attention="flash_attention_2"), T4_ALL, "llama", "Ampere"),
    (FastSpec(attention="flash_attention_2"), H100_BARE, "llama", "flash-attn is not installed"),
    (FastSpec(tf32="on"), T4_ALL, "llama", "8.0"),
    (FastSpec(fused_adamw="on"), CPU, "llama", "CPU"),
])
def test_a_switch_set_on_that_cannot_work_is_a_typed_error_saying_what_to_set(
        fast, device, model_type, says):
    with pytest.raises(FastPathError, match="set train.fast") as info:
        resolve_fast_paths(fast, device, model_type, "bfloat16")
    assert says in str(info.value)


def test_the_plan_shows_the_fast_paths_and_refuses_an_impossible_one():
    remote = plan(RunSpec.parse({
        "method": {"kind": "lora"}, "target": "ssh:gpubox", "parallel": {"strategy": "ddp"},
        "resources": {"gpus_per_node": 1, "gpu_type": "A100-80G"}, "train": {"max_steps": 10}}))
    line = next(a for a in remote.assumptions if a.startswith("fast paths:"))
    # Planned for an A100 elsewhere: what is installed there is unknown, and the plan says so.
    assert line.startswith("fast paths: liger on, flash_attention_2, fused adamw, tf32 on")
    assert "if liger-kernel is installed on the target" in line
    cpu = plan(RunSpec.parse({"train": {"max_steps": 10}}))
    assert any(a.startswith("fast paths: liger off, attention default, adamw, tf32 off")
               for a in cpu.assumptions)
    with pytest.raises(FastPathError, match="train.fast.liger"):
        plan(RunSpec.parse({"train": {"max_steps": 10, "fast": {"liger": "on"}}}))


def test_trainer_arguments_and_model_on_cpu_take_the_resolvers_choices(tiny_model, tmp_path):
    """Real TrainingArguments and a real model load on CPU (no GPU faked here); the 2-process run
    in tests/test_launch.py checks the line a real run records."""
    from transformers import TrainingArguments

    from workbench.train.fastpath import applied_line
    from workbench.train.model import load_model

    spec = RunSpec.parse({"model": {"id": "builtin:tiny-llama"}})
    eager = resolve_fast_paths(FastSpec(attention="eager"), CPU, "llama", "float32")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             **eager.training_kwargs())
    assert (args.use_liger_kernel, str(args.optim.value), args.tf32) == (
        False, "adamw_torch", None)
    model = load_model(spec, str(tiny_model), fast=eager)
    assert model.config._attn_implementation == "eager"  # the choice reached from_pretrained
    assert applied_line(args, model) == "fast paths: liger off, eager, adamw, tf32 off"
    # Left to resolve here (a CPU), the model gets transformers' default attention.
    assert load_model(spec, str(tiny_model)).config._attn_implementation == "sdpa"
