"""The thin views: widgets, magics and the CLI all drive the same library calls."""

from __future__ import annotations

import base64
import io
import re
import subprocess
import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

import workbench
from workbench.cli import main, status_table
from workbench.spec import RunSpec
from workbench.widgets import JobView, RunForm


def test_public_api_is_exactly_the_intended_names():
    assert sorted(workbench.__all__) == sorted([
        "DatasetError", "DatasetFormatError", "EmptyDatasetError", "Job", "JobFailedError",
        "LaunchError", "ModelNotFoundError", "ResourceError", "RunNotFoundError", "RunSpec",
        "SpecError", "WorkbenchError", "__version__", "compare", "credit", "deploy", "evaluate", "get_job",
        "jobs", "launch", "load_ipython_extension", "plan", "sweep", "get_sweep",
    ])
    for name in workbench.__all__:
        assert hasattr(workbench, name), name


def test_run_form_round_trips_a_spec_and_previews_the_data(wb_home):
    spec = RunSpec(name="form-run", method={"kind": "full"}, train={"lr": 1e-3, "epochs": 3})
    form = RunForm(spec)
    got = form.spec
    assert (got.name, got.method.kind, got.train.epochs) == ("form-run", "full", 3)
    assert got == spec  # nothing touched: exactly the spec given
    assert "What" in form.preview.value and "<table" in form.preview.value
    form.lora_r.value = 32
    form.procs.value = 3
    assert form.spec.method.lora_r == 32 and form.spec.resources.procs_per_node == 3


@pytest.mark.parametrize("fields", [
    {"train": {"lr": 3e-3}},  # between the learning-rate slider's steps (3.16e-3)
    {"train": {"lr": 2.5e-7, "epochs": 0.005, "batch_size": 1000}},  # past the widgets' ends
    {"method": {"lora_r": 300}, "resources": {"gpus_per_node": 16, "gpu_type": "H200"}},
    {"resources": {"gpus_per_node": 0, "gpu_type": "MY-CARD"}},  # not in the GPU table
    {"method": {"stage": "dpo"}, "data": {"sources": [{"path": "p.jsonl", "format": "pairs"}]}},
    {"method": {"kind": "qlora"}, "model": {"quantization": "8bit"}},
    {"data": {"sources": [{"path": "qa.csv", "columns": {"prompt": "q", "response": "a"}}]}},
    {"name": "every-knob", "train": {"lr": 1.234e-4, "warmup_ratio": 0.07, "max_steps": 37},
     "eval": {"every_steps": 5}, "budget": {"limit": 12.5}, "checkpoint": {"every_steps": 9},
     "data": {"sources": [{"path": "a.csv", "max_rows": 17}, {"path": "b.jsonl"}]}},
])
def test_the_form_never_changes_a_value_nobody_touched(wb_home, fields):
    spec = RunSpec(**fields)
    form = RunForm(spec)
    assert form.spec == spec
    form.epochs.value = 7  # the one change the user makes
    assert form.spec == spec.updated(**{"train.epochs": 7})


def _stats_line(text: str, split: str) -> tuple[int, list[int]]:
    """(examples, [min, median, p95, max]) of ``split`` in the form's token statistics."""
    m = re.search(split + r": (\d+) examples, tokens min/median/p95/max (\d+)/(\d+)/(\d+)/(\d+)",
                  text)
    assert m, text
    return int(m.group(1)), [int(g) for g in m.groups()[1:]]


@pytest.mark.slow  # the form plans a VLM: its first step is timed here
def test_the_form_shows_image_rows_as_thumbnails_and_counts_their_image_tokens(wb_home):
    from PIL import Image

    from workbench.data.images import load_processor, split_images
    from workbench.data.vision import image_examples
    from workbench.spec.models import resolve_model
    from workbench.spec.sections import DataSource

    form = RunForm(RunSpec(model={"id": "builtin:tiny-qwen2-vl"},
                           data={"sources": [{"path": "builtin:teaching-images"}],
                                 "max_length": 256}))
    # Three rows, each with its picture shrunk to a thumbnail beside its question and answer.
    rows = form.preview.value.split("<tr>")[2:]
    assert len(rows) == 3 and all(r.count("<img") == 1 for r in rows), form.preview.value
    png = base64.b64decode(re.search(r"base64,([^']+)'", rows[0]).group(1))
    assert Image.open(io.BytesIO(png)).size == (64, 64)  # the 84x84 picture, scaled down
    assert "What colour is the shape?" in rows[0] or "How many" in rows[0]
    # The token statistics count each image as the processor expands it: against the processor
    # itself, row by row, on the same rows.
    processor = load_processor(resolve_model("builtin:tiny-qwen2-vl"))
    lengths = []
    for _where, ex in image_examples(DataSource(path="builtin:teaching-images")):
        messages, images = split_images(ex)
        text = processor.apply_chat_template(messages, tokenize=False)
        lengths.append(len(processor(text=[text], images=images)["input_ids"][0]))
    text = "".join(o.get("text", "") for o in form.lengths.outputs)
    (n_train, train), (n_val, val) = _stats_line(text, "train"), _stats_line(text, "validation")
    assert n_train + n_val == len(lengths)
    assert min(train[0], val[0]) == min(lengths) and max(train[3], val[3]) == max(lengths)
    # A text model given the same rows: one line that says which model reads them.
    form.model.value = "builtin:tiny-llama"
    assert "cannot read" in form.preview.value and "<img" not in form.preview.value


def test_the_form_offers_the_column_mapping_a_file_needs(wb_home, tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("Question,Answer\nWhat is 2+2?,4\nCapital of France?,Paris\n")
    form = RunForm(RunSpec(data={"sources": [{"path": str(path)}]}))
    assert "cannot tell the format" in form.preview.value
    assert form.use_columns.layout.display != "none"
    assert form.use_columns.description == "Use columns: prompt=Question, response=Answer"
    form.use_columns.click()
    assert "What is 2+2?" in form.preview.value and "Paris" in form.preview.value
    assert form.use_columns.layout.display == "none"
    assert form.spec.data.sources[0].columns == {"prompt": "Question", "response": "Answer"}
    form.columns.value = "prompt"  # half-written: the form says how to write it
    assert "write PART=COLUMN" in form.message.value and form.launch_button.disabled


def test_run_form_shows_errors_instead_of_launching(tmp_path):
    form = RunForm()
    form.name.value = "has spaces"
    assert form.launch_button.disabled and "name" in form.message.value
    assert form.launch() is None
    form.name.value = "ok"
    assert not form.launch_button.disabled
    form.dataset.value = str(tmp_path / "missing.jsonl")
    assert "not found" in form.preview.value


def test_job_view_renders_a_finished_run(finished_job):
    view = JobView(finished_job)
    assert "succeeded" in view.header.value
    train = view.chart.figure.data[0]  # the interactive chart holds every train step
    assert list(train.x) == list(range(1, 41)) and len(view.chart.figure.data[2].x) > 0
    assert "step <b>40</b>" in view.stats.value
    assert view.cancel_button.disabled and view.cancel_button.layout.display == "none"
    assert view.progress.value == view.progress.max == 40


def test_magics_run_cli_commands_in_the_kernel(finished_job, capsys):  # noqa: F811
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "workbench")
    # The shared run is older than the newest 20 (the list's default) in a whole-suite session.
    shell.run_line_magic("workbench", "status --limit 100000")
    assert finished_job.id in capsys.readouterr().out
    shell.run_cell_magic("runspec", "myspec", "name: from-magic\ntrain: {max_steps: 3}\n")
    assert shell.user_ns["myspec"].train.max_steps == 3
    shell.run_cell_magic("runspec", "bad", "train: {max_step: 3}\n")
    assert "did you mean 'max_steps'" in capsys.readouterr().out
    assert "bad" not in shell.user_ns
    shell.run_line_magic("workbench", "logs no-such-run")
    assert "no run with id or name" in capsys.readouterr().out


def test_cli_status_logs_cancel_and_errors(finished_job, capsys, tmp_path):  # noqa: F811
    assert main(["status", "--limit", "100000"]) == 0
    assert finished_job.id in capsys.readouterr().out
    assert main(["status", finished_job.id]) == 0
    assert "succeeded" in capsys.readouterr().out
    assert main(["logs", finished_job.id, "--tail", "3", "--name", "rank-0.log"]) == 0
    assert "saved" in capsys.readouterr().out
    assert main(["cancel", finished_job.id]) == 0  # already ended: stays succeeded
    assert "succeeded" in capsys.readouterr().out
    assert main(["launch", str(tmp_path / "nope.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().err
    table = status_table([finished_job])
    assert table.splitlines()[0].split() == ["RUN", "TARGET", "STATE", "STEP", "LOSS", "ETA"]


def test_cli_entry_point_prints_a_default_spec_that_loads(tmp_path):
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "spec", "-o",
                          str(tmp_path / "s.yaml")], capture_output=True, text=True, check=True)
    assert "wrote" in out.stdout
    assert RunSpec.from_yaml(tmp_path / "s.yaml") == RunSpec()


def test_run_form_shows_the_plan_live_and_launch_refuses_what_cannot_fit(wb_home):
    form = RunForm(RunSpec(parallel={"strategy": "ddp"}))
    assert "Strategy" in form.plan_text.value
    assert form.plan_plot.value[:4] == b"\x89PNG"
    before = form.plan_text.value
    form.model.value = "meta-llama/Llama-2-7b-hf"  # offline config table: no download
    form.method.value = "full"
    form.gpus.value = 1
    form.gpu_type.value = "A100-80G"  # full 7B under plain DDP needs ~130 GB per GPU
    assert form.plan_text.value != before
    assert "DOES NOT FIT" in form.plan_text.value
    assert form.launch() is None  # refused (this machine has no GPU at all)
    assert "gpus_per_node" in form.message.value
