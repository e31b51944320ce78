"""The optimizer stepped inside backward (train.optimizer_in_backward), trained for real on CPU:
the built-in tiny model, full fine-tuning in fp32 with the Trainer's arguments built from a spec
(workbench.train.arguments), a few steps of the real HF Trainer loop in this process.

How it tests: the same spec, data and seed are trained twice, once stepping after backward and
once in it; per-parameter AdamW in fp32 does the same arithmetic as one AdamW over every
parameter, so the weights must agree to float rounding. A resume from a snapshot taken mid-run
must end at the weights of the uninterrupted run (the per-parameter optimizers' states and the
schedule are saved and loaded). The spec's refusals are in tests/test_spec.py's style below.
"""

from __future__ import annotations

import pytest
import torch

from workbench.errors import SpecError
from workbench.spec import RunSpec

STEPS = 4


@pytest.fixture
def train(tmp_path, monkeypatch, tiny_model):
    """train(in_backward, steps, name, resume_step=None, save_at=None) -> the trained trainer."""
    from transformers import AutoModelForCausalLM, TrainerCallback, set_seed

    from workbench.runs.rundir import RunDir
    from workbench.runs.snapshots import snapshot_dir
    from workbench.train.arguments import training_arguments
    from workbench.train.snapshotting import snapshotting_trainer_class

    # What training_arguments sets for a CPU run, restored after the test.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    class SaveAt(TrainerCallback):
        def __init__(self, step: int | None) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step == self.step

    def run(in_backward: bool, name: str, resume_step: int | None = None,
            save_at: int | None = None, resume_dir=None):
        spec = RunSpec(name=name, method={"kind": "full"},
                       train={"max_steps": STEPS, "batch_size": 2, "lr": 3e-3,
                              "weight_decay": 0.1, "warmup_ratio": 0.25, "scheduler": "cosine",
                              "optimizer_in_backward": in_backward, "max_grad_norm": 0},
                       resources={"processes_per_node": 1}, parallel={"strategy": "ddp"},
                       tracking={"tensorboard": False})
        rd = RunDir(tmp_path / name).create(spec)
        set_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 100, (16, 24),
                                                                           generator=gen)]
        args = training_arguments(spec, rd, has_eval=False)
        trainer = snapshotting_trainer_class()(
            model=model, args=args, train_dataset=rows, callbacks=[SaveAt(save_at)],
            run_dir=rd, keep=5, optimizer_in_backward=in_backward)
        trainer.train(resume_from_checkpoint=str(snapshot_dir(resume_dir, resume_step))
                      if resume_step else None)
        trainer.writer.wait()
        trainer.rd = rd
        return trainer
    return run


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def test_in_backward_trains_the_weights_the_ordinary_step_trains(train):
    ordinary, in_bwd = train(False, "ordinary"), train(True, "in-backward")
    a, b = _weights(ordinary), _weights(in_bwd)
    assert a.keys() == b.keys()
    start = {n: p.detach() for n, p in type(ordinary.model).from_pretrained(
        ordinary.model.name_or_path, dtype=torch.float32).named_parameters()}
    assert all(not torch.equal(a[n], start[n]) for n in a)  # every weight trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert in_bwd.args.max_grad_norm == 0.0 and ordinary.args.max_grad_norm == 0.0
    # The hooks' summed norm is the norm the Trainer computes from whole gradients.
    assert len(_grad_norms(in_bwd)) == len(_grad_norms(ordinary)) == STEPS
    assert _grad_norms(in_bwd) == pytest.approx(_grad_norms(ordinary), rel=1e-4)
    assert all(p.grad is None for p in in_bwd.model.parameters())  # every gradient freed


def test_a_resume_from_a_snapshot_ends_at_the_uninterrupted_weights(train):
    from workbench.runs.snapshots import snapshot_dir, verify

    whole = train(True, "whole", save_at=2)
    snap = snapshot_dir(whole.rd, 2)
    assert verify(snap) is None
    saved = torch.load(snap / "optimizer.pt", weights_only=True)
    per_param = saved["per_parameter"]
    assert len(per_param) == sum(1 for _ in whole.model.parameters())
    assert all(sd["state"][0]["step"] == 2 for sd in per_param)  # two AdamW steps each
    resumed = train(True, "resumed", resume_step=2, resume_dir=whole.rd)
    assert resumed.state.global_step == STEPS
    a, b = _weights(whole), _weights(resumed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    # The schedule went on from the snapshot: the same learning rates at steps 3 and 4.
    lrs = [[h["learning_rate"] for h in t.state.log_history if "learning_rate" in h][-2:]
           for t in (whole, resumed)]
    assert lrs[0] == pytest.approx(lrs[1])


@pytest.mark.parametrize(("train_knobs", "other", "fragment"), [
    ({"grad_accum": 2}, {}, "set train.grad_accum: 1"),
    ({"max_grad_norm": 1.0}, {}, "set train.max_grad_norm: 0"),
    ({}, {"parallel": {"strategy": "zero2"}}, "DeepSpeed ZeRO steps its own optimizer"),
    ({}, {"resources": {"gpus_per_node": 2}}, "it runs in one process"),
    ({}, {"method": {"kind": "lora"}}, "it is for method.kind full"),
])
def test_bad_combinations_are_refused_with_what_to_set(train_knobs, other, fragment):
    spec = {"method": {"kind": "full"}, "resources": {"processes_per_node": 1},
            "train": {"optimizer_in_backward": True, **train_knobs}, **other}
    with pytest.raises(SpecError, match="train.optimizer_in_backward is true") as info:
        RunSpec.parse(spec)
    assert fragment in str(info.value)


def test_pure_bf16_weights_are_refused_where_they_cannot_train():
    from workbench.spec.precision import resolve_precision

    with pytest.raises(SpecError, match="set model.dtype: auto"):
        RunSpec.parse({"method": {"kind": "full"}, "model": {"dtype": "float32"},
                       "train": {"master_weights": "none"}})
    with pytest.raises(SpecError, match="train.master_weights"):
        resolve_precision("auto", "full", "cpu", master_weights="none")
    with pytest.raises(SpecError, match="fp16's loss scaler"):
        resolve_precision("auto", "full", "cuda-fp16", in_backward=True)
    # On a bf16 card the optimizer in backward trains bf16 weights unless told to keep fp32.
    assert resolve_precision("auto", "full", "cuda-bf16", in_backward=True).load_dtype == "bfloat16"
    assert resolve_precision("auto", "full", "cuda-bf16", in_backward=True,
                             master_weights="fp32").load_dtype == "float32"
    assert resolve_precision("auto", "full", "cpu", in_backward=True).load_dtype == "float32"
