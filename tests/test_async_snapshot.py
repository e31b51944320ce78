"""The asynchronous snapshot writer on its own (no Trainer): what it writes is what training held
at the save even though training goes on, because the next optimizer step waits for the copy;
its hashes are those of the files; the buffers it reuses are never still being written."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from workbench.train import async_snapshot
from workbench.train.async_snapshot import AsyncWriter


class Training:
    """A model and its Adam state, changed in place by each step, as in the Trainer's loop."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(32, 64)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.1)
        self.step()  # so the optimizer has state to save

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(8, 32)).square().sum().backward()
        self.opt.step()

    def save(self, writer: AsyncWriter, folder: Path) -> dict[str, torch.Tensor]:
        """Save as the Trainer does; returns the values that must reach the files."""
        folder.mkdir()
        with writer.capture():
            torch.save(self.opt.state_dict(), folder / "optimizer.pt")
            # through the module, as transformers does: the writer patches module attributes
            safetensors.torch.save_file(self.model.state_dict(), str(folder / "model.safetensors"),
                                        metadata={"format": "pt"})
        return {"weight": self.model.weight.detach().clone(),
                "exp_avg": self.opt.state_dict()["state"][0]["exp_avg"].clone()}


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    return {"weight": load_file(str(folder / "model.safetensors"))["weight"],
            "exp_avg": torch.load(folder / "optimizer.pt")["state"][0]["exp_avg"]}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_files_hold_the_state_at_the_save_and_the_manifest_hashes(tmp_path):
    writer, training = AsyncWriter(0), Training()
    for n in range(3):  # the 2nd and 3rd saves copy into the buffers of the previous one
        folder = tmp_path / f"checkpoint-{n}"
        expect = training.save(writer, folder)
        writer.flush_async(folder)
        training.step()  # training goes on, in place, while the thread copies and writes
        writer.wait()
        assert (folder / ".done-rank-0").is_file()
        for name in ("optimizer.pt", "model.safetensors"):
            data = (folder / name).read_bytes()
            assert writer.hashes[str(folder / name)] == (hashlib.sha256(data).hexdigest(),
                                                         len(data))
        assert _same(_saved(folder), expect)
        assert not torch.equal(training.model.weight, expect["weight"])  # it did change since
        with safe_open(str(folder / "model.safetensors"), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}


def test_the_next_optimizer_step_waits_until_the_copy_is_complete(tmp_path, monkeypatch):
    go = threading.Event()
    real_run = async_snapshot._Copies.run

    def held_back(copies):  # the writer thread, slowed down before it copies
        go.wait()
        real_run(copies)

    monkeypatch.setattr(async_snapshot._Copies, "run", held_back)
    writer, training = AsyncWriter(0), Training()
    expect = training.save(writer, tmp_path / "checkpoint-1")
    writer.flush_async(tmp_path / "checkpoint-1")
    stepped = threading.Event()
    trainer = threading.Thread(target=lambda: (training.step(), stepped.set()))
    trainer.start()
    assert not stepped.wait(0.5)  # the step is held at its start
    assert torch.equal(training.model.weight, expect["weight"])
    go.set()
    trainer.join(30)
    assert stepped.is_set()
    writer.wait()
    assert _same(_saved(tmp_path / "checkpoint-1"), expect)
    # reported as stall: the step was held from its start (a few ms into the 0.5 s) until `go`
    assert writer.current is not None and writer.current.wait_s > 0.2


def test_a_failed_copy_releases_training_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def broken(copies):
        raise OSError("no memory for the copy")

    monkeypatch.setattr(async_snapshot._Copies, "run", broken)
    writer, training = AsyncWriter(0), Training()
    training.save(writer, tmp_path / "checkpoint-1")
    writer.flush_async(tmp_path / "checkpoint-1")
    trainer = threading.Thread(target=training.step)
    trainer.start()
    trainer.join(30)
    assert not trainer.is_alive()  # not held forever by a copy that will never finish
    writer.wait()
    assert "snapshot write failed" in capsys.readouterr().out
    # never committed: no data written, only the marker telling rank 0 why
    assert [p.name for p in (tmp_path / "checkpoint-1").iterdir()] == [".failed-rank-0"]
    assert "no memory for the copy" in (tmp_path / "checkpoint-1" / ".failed-rank-0").read_text()


def test_a_save_while_the_previous_one_is_written_copies_into_other_memory(tmp_path):
    writer, training = AsyncWriter(0), Training()
    training.save(writer, tmp_path / "checkpoint-1")
    writer.flush_async(tmp_path / "checkpoint-1")
    writer.wait()
    recycled = {id(t) for bufs in writer._free.values() for t in bufs}
    assert recycled  # the first snapshot's buffers, free once written

    training.step()
    expect = training.save(writer, tmp_path / "checkpoint-2")
    assert writer.current is not None
    second = {id(buf) for _, buf in writer.current.held}
    assert second == recycled  # copied into them
    go = threading.Event()
    writer._jobs.insert(0, go.wait)  # the writer copies, then waits before it writes checkpoint-2
    writer.flush_async(tmp_path / "checkpoint-2")
    training.step()
    latest = training.save(writer, tmp_path / "checkpoint-3")
    assert not {id(buf) for _, buf in writer.current.held} & second
    go.set()
    writer.flush_async(tmp_path / "checkpoint-3")
    writer.wait()
    assert _same(_saved(tmp_path / "checkpoint-2"), expect)
    assert _same(_saved(tmp_path / "checkpoint-3"), latest)


def test_the_trainer_snapshots_the_weights_of_each_save_step_though_the_copy_lags(
        tmp_path, monkeypatch):
    """The real Trainer loop (HF Trainer + accelerate's optimizer wrapper): every step saves, the
    writer starts copying only 0.5 s later (several steps of this model), and each committed
    snapshot still holds the weights of its own step, because each next step waited."""
    from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

    from workbench.assets import builtin_model_path
    from workbench.runs.rundir import RunDir
    from workbench.runs.snapshots import snapshot_dir, verify
    from workbench.spec import RunSpec
    from workbench.train.snapshotting import snapshotting_trainer_class

    real_run = async_snapshot._Copies.run

    def late(copies):
        time.sleep(0.5)
        real_run(copies)

    monkeypatch.setattr(async_snapshot._Copies, "run", late)
    held: dict[int, dict[str, torch.Tensor]] = {}

    class SaveEveryStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            held[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
            control.should_save = True

    rd = RunDir(tmp_path / "run").create(RunSpec())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(builtin_model_path())
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 100, (16, 16))]
    args = TrainingArguments(output_dir=str(rd.path / "checkpoints"), max_steps=4,
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = snapshotting_trainer_class()(model=model, args=args, train_dataset=rows,
                                           callbacks=[SaveEveryStep()], run_dir=rd, keep=10)
    trainer.train()
    trainer.writer.wait()
    for step in range(1, 5):
        folder = snapshot_dir(rd, step)
        assert verify(folder) is None
        saved = load_file(str(folder / "model.safetensors"))
        assert saved.keys() & held[step].keys()
        for name in saved.keys() & held[step].keys():
            assert torch.equal(saved[name], held[step][name]), (step, name)
    assert not torch.equal(held[1]["model.embed_tokens.weight"], held[4]["model.embed_tokens.weight"])
    stalls = [m["stall_s"] for m in rd.metrics() if m.get("event") == "snapshot"]
    assert len(stalls) == 4 and all(s > 0.1 for s in stalls[:3])  # the waits are reported
