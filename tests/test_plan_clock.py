"""The plan's step time counts what a step really processes and does: packed rows hold whole
examples only, full fine-tuning pays its optimizer step, and validation passes are held too."""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings

import pytest

import workbench
from workbench.plan import plan
from workbench.plan.calibrate import CalibrationWarning, calibration_file


def _rows(path, n):
    # Answers of 30-69 words: a few of them fill a 256-token row, with room left over.
    rows = [{"messages": [{"role": "user", "content": f"Count for me, please ({i})."},
                          {"role": "assistant",
                           "content": " ".join(f"w{j}" for j in range(30 + (7 * i) % 40))}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_packed_rows_are_planned_at_the_tokens_they_hold_not_max_length(tmp_path):
    from workbench.assets import builtin_model_path
    from workbench.data.tokenize import load_tokenizer
    from workbench.data.tokenized import tokenize_split

    path = _rows(tmp_path / "rows.jsonl", 400)
    spec = workbench.RunSpec(
        data={"sources": [{"path": str(path)}], "validation_fraction": 0, "max_length": 256,
              "packing": True},
        train={"batch_size": 4}, resources={"processes_per_node": 1})
    p = plan(spec)
    # What the trainer will really get: the data tokenised and packed by the run's own code.
    table, _ = tokenize_split(path, spec, load_tokenizer(spec, str(builtin_model_path())))
    lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
    real_per_row = sum(lengths) / len(lengths)
    assert real_per_row < 0.9 * 256  # the data is shaped so that rows are visibly short
    assert p.tokens_per_step / 4 == pytest.approx(real_per_row, rel=0.05)
    assert p.steps == pytest.approx(len(lengths) / 4, rel=0.05)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    return tmp_path


def _store_calibration(optimizer_params_per_s: float, load_bytes_per_s: float | None = None,
                       save_bytes_per_s: float | None = None) -> None:
    """A calibration of this machine as `workbench targets check local` would store it, with the
    FLOPs figures fixed and the optimizer's (and the weights' load) rate chosen by the test."""
    from workbench.plan.calibrate import device_identity

    calibration_file("local").write_text(json.dumps({
        "target": "local", "date": "2026-12-01", "device": device_identity(False),
        "dtype": "float32", "matmul_gflops": 20.0, "layers": {"256": 8.0, "1024": 20.0},
        "optimizer_params_per_s": optimizer_params_per_s, "load_bytes_per_s": load_bytes_per_s,
        "save_bytes_per_s": save_bytes_per_s}))


def test_a_calibrated_optimizer_rate_prices_full_fine_tuning_more_than_lora(home):
    # Qwen2.5-0.5B (planned from its config, nothing loaded): full trains ~500M parameters,
    # LoRA a few million adapter weights.
    full = {"model": {"id": "Qwen/Qwen2.5-0.5B"}, "method": {"kind": "full"},
            "train": {"max_steps": 10}, "resources": {"processes_per_node": 1}}
    lora = {**full, "method": {"kind": "lora"}}
    _store_calibration(1e8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # read, not refused
        before = plan(full).clock["step_s"], plan(lora).clock["step_s"]
        _store_calibration(1e7)  # a host whose optimizer step is 10x slower
        after = plan(full).clock["step_s"], plan(lora).clock["step_s"]
    assert after[0] > before[0] and after[1] >= before[1]
    assert after[0] - before[0] > 10 * (after[1] - before[1])
    # Full fine-tuning of 500M parameters at 1e7 per second cannot take under 50 s a step.
    assert after[0] > 50


def test_the_start_up_makes_every_ranks_weights_ready_at_the_measured_load_rate(home):
    # Qwen2.5-0.5B from its config (nothing loaded), LoRA: ~2 GB of float32 weights per CPU rank.
    # Its start-up was planned 46 % short on 2 processes (8.4 s against 15.7 s, idle): a loaded
    # run's ranks spent 7.4 s loading at once, then DDP broadcast every parameter. (The Trainer's
    # move of the model to the device copied them too, until the ranks' device was "cpu".)
    spec = {"model": {"id": "Qwen/Qwen2.5-0.5B"}, "train": {"max_steps": 4}}

    def startup(procs: int, rate: float) -> float:
        _store_calibration(1e8, rate)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CalibrationWarning)  # read, not refused
            return plan({**spec, "resources": {"processes_per_node": procs}}).clock["startup_s"]

    one, two = (startup(1, 1e9) - startup(1, 2e9)), (startup(2, 1e9) - startup(2, 2e9))
    assert one >= 0.9  # ~2 GB made ready at 1 GB/s instead of 2 GB/s
    # Two ranks on one host: each loads the weights, at once, and trains them where they are.
    assert two == pytest.approx(2 * one, rel=0.05)
    assert startup(2, 1e9) - startup(1, 1e9) > one  # the second rank's load, DDP's set-up


def test_a_cpu_full_fine_tunes_first_step_makes_its_optimizer_state_in_the_start_up(home):
    # The 0.5B full fine-tune's first step took 4.1 s beyond the next ones (idle): its gradients
    # and AdamW's states, ~6 GB, made in new memory. Planned apart from the step, as start-up.
    full = {"model": {"id": "Qwen/Qwen2.5-0.5B"}, "method": {"kind": "full"},
            "train": {"max_steps": 4}, "resources": {"processes_per_node": 1}}
    lora = {**full, "method": {"kind": "lora"}}

    def first(spec: dict, rate: float) -> float:
        _store_calibration(1e8, rate)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CalibrationWarning)  # read, not refused
            return plan(spec).startup_s["first step"]

    assert first(full, 1e9) > 4  # at least gradients + two fp32 states of ~500M parameters
    assert first(full, 1e9) == pytest.approx(2 * first(full, 2e9))
    assert first(lora, 1e9) < 0.2  # a few million adapter weights
    two = plan({**full, "resources": {"processes_per_node": 2}}).startup_s["first step"]
    assert two == pytest.approx(2 * first(full, 1e9))  # both ranks at once on one host
    gpu = plan({**full, "resources": {"gpus_per_node": 1, "gpu_type": "H100"}})
    assert not gpu.startup_s["first step"]


def test_the_finish_saves_what_the_method_trained_at_the_measured_save_rate(home):
    # A fixed 3 s finish was 10x the tiny model's (0.2 s after its scoring and validation), and
    # full fine-tuning of Qwen2.5-0.5B saves ~2 GB of float32 weights (4.5 s, idle, measured).
    full = {"model": {"id": "Qwen/Qwen2.5-0.5B"}, "method": {"kind": "full"},
            "train": {"max_steps": 4}, "resources": {"processes_per_node": 1}}
    lora = {**full, "method": {"kind": "lora"}}

    def finish(spec: dict, rate: float) -> float:
        _store_calibration(1e8, 1e9, rate)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CalibrationWarning)  # read, not refused
            return plan(spec).clock["finish_s"]

    assert finish(full, 1e9) - finish(full, 2e9) >= 0.9  # ~2 GB at 1 GB/s instead of 2
    assert finish(lora, 1e9) - finish(lora, 2e9) < 0.1  # an adapter of a few MB
    assert finish(full, 1e9) > finish(lora, 1e9) + 1.5
    assert plan({**lora, "model": {"id": "builtin:tiny-llama"}}).clock["finish_s"] < 1.5


def test_validation_passes_are_held_and_planned(home):
    base = workbench.RunSpec(train={"max_steps": 20}, resources={"processes_per_node": 1},
                             budget={"price_per_cpu_core_hour": 1.0})
    none = plan(base.updated(**{"data.validation_fraction": 0.0}))
    end = plan(base.updated(**{"train.eval_every": 0}))
    every = plan(base.updated(**{"train.eval_every": 1}))
    assert none.clock["eval_s"] == 0
    assert 0 < end.clock["eval_s"] < every.clock["eval_s"]
    assert every.clock["total_s"] - end.clock["total_s"] == pytest.approx(
        every.clock["eval_s"] - end.clock["eval_s"])
    assert every.cost > end.cost > none.cost


def test_the_runs_own_scoring_is_planned_per_pass_and_priced(home):
    base = workbench.RunSpec(train={"max_steps": 20}, resources={"processes_per_node": 1},
                             budget={"price_per_cpu_core_hour": 1.0})
    after = plan(base)  # the default eval: heldout once, after training
    off = plan(base.updated(**{"eval.after": False}))
    both = plan(base.updated(**{"eval.before": True}))
    assert off.clock["scoring_s"] == 0 and after.clock["scoring_s"] > 0
    # Scoring is held like training: in the total and the cost, apart from the steps.
    assert after.clock["total_s"] - off.clock["total_s"] == pytest.approx(
        after.clock["scoring_s"])
    assert after.clock["step_s"] == off.clock["step_s"] and after.cost > off.cost
    # before + after scores the same prompts a second time; every 5 of 20 steps adds 3 more
    # passes (step 20 is after's): each pass the same seconds. The metric libraries are imported
    # once in the run, so two passes cost more than one but at most twice as much.
    one_more = both.clock["scoring_s"] - after.clock["scoring_s"]
    assert one_more > 0 and both.clock["scoring_s"] <= 2 * after.clock["scoring_s"]
    every = plan(base.updated(**{"eval.before": True, "eval.every_steps": 5}))
    assert every.clock["scoring_s"] - both.clock["scoring_s"] == pytest.approx(3 * one_more,
                                                                               rel=0.02)
    # Longer answers cost more; fewer prompts less.
    longer = plan(base.updated(**{"eval.tasks": [{"kind": "heldout", "max_new_tokens": 128}]}))
    fewer = plan(base.updated(**{"eval.tasks": [{"kind": "heldout", "max_samples": 2}]}))
    assert longer.clock["scoring_s"] > after.clock["scoring_s"] > fewer.clock["scoring_s"] > 0
    assert "Scoring: " in after.summary() and "Scoring: " not in off.summary()


@pytest.mark.parametrize("rows", [180, 1500])
def test_scoring_counts_the_validation_examples_not_the_packed_rows(home, tmp_path, rows):
    # heldout generates one answer per validation EXAMPLE; packing folds several examples into a
    # row, and the plan once counted packed rows: 6 prompts planned, 22 scored, a 0.5B run's
    # total planned 59 % short (issue 21). 1500 rows is past the planner's 512-row sample.
    import re

    from workbench.data.prepare import prepare_data

    path = _rows(tmp_path / "rows.jsonl", rows)
    spec = workbench.RunSpec(
        data={"sources": [{"path": str(path)}], "max_length": 1024, "packing": True},
        train={"batch_size": 4, "max_steps": 10}, resources={"processes_per_node": 1},
        eval={"tasks": [{"kind": "heldout", "max_samples": 10_000}]})
    scored = prepare_data(spec, tmp_path / "prepared").counts["validation"]
    planned = int(re.search(r"heldout (\d+) prompts", plan(spec).clock["scoring"]).group(1))
    assert scored > 0
    assert planned == pytest.approx(scored, rel=0.1 if rows > 512 else 0)


def test_an_lm_eval_task_is_named_as_not_estimated(home):
    base = workbench.RunSpec(train={"max_steps": 20}, resources={"processes_per_node": 1})
    p = plan(base.updated(**{"eval.tasks": [{"kind": "lm_eval", "tasks": ["hellaswag"]},
                                            "heldout"]}))
    assert "not estimated: lm_eval hellaswag" in p.clock["scoring"]
    assert "not estimated: lm_eval hellaswag" in p.summary()
    heldout_only = plan(base)
    assert p.clock["scoring_s"] == pytest.approx(heldout_only.clock["scoring_s"])


@pytest.mark.parametrize("packing", [True, False])
def test_the_measured_step_is_fed_the_batch_the_runs_collator_builds(monkeypatch, tmp_path,
                                                                     packing):
    # The run's collator lays a packed micro-batch end to end in ONE row (position_ids restarting
    # per example), so attention spans micro-batch x tokens: on this machine 8 x 439 tokens took
    # 1.7x as long that way as in 8 separate rows, and the calibration, timing separate rows,
    # planned the 512-token runs 2.7x short. The step must be timed on the run's batch, through
    # the run's own Trainer (a hand loop missed half its step: issue 21).
    from workbench.data.batches import Collator, pack
    from workbench.plan.shape import model_shape
    from workbench.train import steprank

    spec = workbench.RunSpec(data={"packing": packing, "max_length": 64},
                             train={"batch_size": 3}, resources={"processes_per_node": 1})
    seen, starts = [], []
    real = steprank.time_train_steps

    def recording(model, *a, **kw):
        def hook(m, args, kwargs):
            seen.append(kwargs)
            starts.append(time.perf_counter())

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return real(model, *a, **kw)

    monkeypatch.setattr(steprank, "time_train_steps", recording)
    monkeypatch.setattr(steprank, "_time_generate", lambda *a: (1.0, 1.0))  # not under test
    # The run's training_arguments set a rank's environment (TensorBoard's folder, accelerate's
    # device): here they run in the test process, so every later test's runs would inherit them.
    for key, value in os.environ.items():
        monkeypatch.setenv(key, value)
    for key in ("TENSORBOARD_LOGGING_DIR", "ACCELERATE_TORCH_DEVICE"):
        monkeypatch.delenv(key, raising=False)
    run_dir = steprank._scratch_run_dir(spec, tmp_path / "scratch")
    job = {"vocab": model_shape(spec.model.id).vocab, "layers": 2, "seq": 20, "dtype": "float32",
           "load_dtype": "float32", "on_gpu": False}
    step, fwd_bwd, *_ = steprank._measure_layers(spec, job, 1, run_dir)
    # The measured step is the whole of one: forward to forward, read here from the model's own
    # forward calls (warm-up left out), the optimizer, loader and callbacks in it. Its forward +
    # backward share is less. (The step measured forward + backward alone for a while, the two
    # swapped on their way to the plan, and planned the run's step 20-30 % short: issue 21.)
    # The two medians cover the same steps but the last (it has no next forward), over 4 to 6
    # steps: on a loaded machine one slow step moves either by up to ~20 %. Forward + backward
    # alone was 20-30 % short of the step, and must be shorter than it.
    gaps = [b - a for a, b in zip(starts[3:], starts[4:], strict=False)]
    assert step == pytest.approx(statistics.median(gaps), rel=0.25), (step, gaps)
    assert 0 < fwd_bwd < step
    # Every step of the Trainer's (warm-up and timed) got the run's micro-batch: built here from
    # three 20-token rows by the run's own pack (packed) or plain rows (unpacked) and Collator.
    # (2 warm-up steps, then at least 4 timed and 2 s of them, at most 64 steps in all.)
    assert 7 <= len(seen) <= 64
    examples = [{"input_ids": [5] * 20, "labels": [5] * 20} for _ in range(3)]
    rows = pack(examples, 20) if packing else examples
    want = Collator(pad_token_id=0)(rows)
    for batch in seen:
        assert sorted(set(batch) - {"num_items_in_batch"}) == sorted(want)  # the Trainer's
        for key, value in want.items():
            assert tuple(batch[key].shape) == tuple(value.shape), key
        if packing:
            assert tuple(batch["input_ids"].shape) == (1, 60)
            assert batch["position_ids"][0].tolist() == list(range(20)) * 3


def test_a_split_short_of_the_batch_is_planned_at_the_rows_its_steps_carry(tmp_path):
    # 8 examples packed into a few 512-token rows, batch_size 8: one process trains steps of
    # those few rows; two get every batch filled with rows from the start (accelerate's
    # even_batches). The plan counted 8 rows per rank either way.
    import datasets
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from workbench.assets import builtin_model_path
    from workbench.data.batches import Collator
    from workbench.data.tokenize import load_tokenizer
    from workbench.data.tokenized import tokenize_split

    path = _rows(tmp_path / "rows.jsonl", 8)
    spec = workbench.RunSpec(
        data={"sources": [{"path": str(path)}], "validation_fraction": 0, "max_length": 512,
              "packing": True},
        train={"batch_size": 8, "epochs": 2})
    model_dir = str(builtin_model_path())
    tokenizer = load_tokenizer(spec, model_dir)
    rows = datasets.Dataset(tokenize_split(path, spec, tokenizer)[0])
    assert len(rows) < 8
    # The Trainer's own training loader, and its arguments' deal of the batches to each rank.
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                      args=TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8,
                                             num_train_epochs=2, report_to=[], use_cpu=True),
                      train_dataset=rows, data_collator=Collator(tokenizer.pad_token_id))
    loader = trainer.get_train_dataloader()
    for ranks in (1, 2):
        p = plan(spec.model_copy(update={"resources": workbench.RunSpec(
            resources={"processes_per_node": ranks}).resources}))
        loaders = [loader] if ranks == 1 else [
            prepare_data_loader(DataLoader(rows, batch_size=8, collate_fn=loader.collate_fn,
                                           drop_last=trainer.args.dataloader_drop_last),
                                num_processes=ranks, process_index=r,
                                even_batches=trainer.args.accelerator_config.even_batches)
            for r in range(ranks)]
        batches = [list(ld) for ld in loaders]  # one epoch, each rank's micro-batches
        assert len({len(b) for b in batches}) == 1  # every rank takes the same number of steps
        tokens = sum(int(x["input_ids"].numel()) for b in batches for x in b)
        assert p.tokens_per_step == pytest.approx(tokens / len(batches[0]), rel=0.1), ranks
        assert p.steps == 2 * len(batches[0]), ranks
