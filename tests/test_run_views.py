"""What a newcomer reads about a finished run: the loss table, the eval curve, the plot (in a
notebook and, saved as a file, from ``workbench demo``), and logs without library noise.

One real two-process run of the built-in tiny model, with the default evaluation schedule, is
shared by the tests that only read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from IPython.core.formatters import DisplayFormatter
from nbformat.v4 import new_code_cell, new_notebook

import workbench
from workbench.cli import main as cli_main
from workbench.errors import SpecError, WorkbenchError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NOISE = ("Setting accelerator to CPU", "is_gradient_checkpointing", "FutureWarning")


@pytest.fixture(scope="module")
def finished_run(finished_job: workbench.Job) -> workbench.Job:
    # The suite's shared finished run (tests/conftest.py): train.eval_every left unset, the
    # default schedule is what a newcomer gets.
    return finished_job


def _jsonl(job: workbench.Job) -> list[dict]:
    lines = job.run_dir.metrics_file.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_metrics_df_is_a_loss_table_and_eval_losses_stay_reachable(finished_run) -> None:
    last = finished_run.spec.train.max_steps
    df = finished_run.metrics_df()
    assert df["loss"].notna().all(), df[df["loss"].isna()]
    assert list(df["step"]) == list(range(1, last + 1))
    # What the trainer measured on the validation split, read straight from metrics.jsonl.
    measured = {r["step"]: r["eval_loss"] for r in _jsonl(finished_run) if "eval_loss" in r}
    evals = finished_run.eval_df()
    assert dict(zip(evals["step"], evals["eval_loss"])) == measured
    # The default schedule draws a curve (several points, through the run), not one end dot,
    # and measures the last step once.
    assert len(measured) >= 5 and min(measured) <= last // 4 and max(measured) == last
    assert evals["step"].is_unique
    on_rows = df.dropna(subset=["eval_loss"])
    assert dict(zip(on_rows["step"], on_rows["eval_loss"])) == measured


@pytest.mark.slow
def test_the_plot_displays_as_a_png_without_pyplot(finished_run) -> None:
    fig = finished_run.plot()
    data, _ = DisplayFormatter().format(fig)  # what IPython sends to JupyterLab / nbconvert
    assert data["image/png"][:8] == PNG_MAGIC
    labels = {line.get_label() for line in fig.axes[0].get_lines()}
    assert labels == {"train loss", "eval loss"}


@pytest.mark.slow
def test_demo_saves_each_plot_as_a_png_and_prints_its_path(finished_run, tmp_path, capfd) -> None:
    nb = new_notebook(cells=[
        new_code_cell(f"import workbench\njob = workbench.get_job({finished_run.id!r})\njob.plot()"),
        new_code_cell("print('after the plot')"),
    ], metadata={"kernelspec": {"name": "workbench", "display_name": "Python (Workbench)",
                                "language": "python"}})
    path = tmp_path / "plots.ipynb"
    nbformat.write(nb, path)
    figures = tmp_path / "figures"
    assert cli_main(["demo", "--notebook", str(path), "--figures", str(figures)]) == 0
    out, err = capfd.readouterr()  # the kernel's own output too (it shares the terminal)
    assert "<Figure" not in out and "WARNING" not in out + err, out + err
    saved = [line.split("plot saved to ", 1)[1] for line in out.splitlines()
             if line.startswith("plot saved to ")]
    assert len(saved) == 1 and Path(saved[0]).parent == figures
    assert Path(saved[0]).read_bytes()[:8] == PNG_MAGIC
    assert out.index("plot saved to") < out.index("after the plot")


def test_demo_names_a_missing_kernel_and_how_to_install_it(tmp_path) -> None:
    nb = new_notebook(cells=[new_code_cell("1")], metadata={
        "kernelspec": {"name": "no-such-kernel", "display_name": "x", "language": "python"}})
    nbformat.write(nb, tmp_path / "x.ipynb")
    with pytest.raises(WorkbenchError, match="jupyter kernelspec install .*no-such-kernel"):
        workbench.cli.run(["demo", "--notebook", str(tmp_path / "x.ipynb")])


@pytest.mark.slow
def test_rank_logs_and_the_kernel_side_carry_no_known_library_noise(finished_run) -> None:
    for log in finished_run.run_dir.logs_dir.glob("rank-*.log"):
        text = log.read_text()
        assert "saved " in text or "rank 1/" in text  # a real rank log, read to its end
        assert not [n for n in NOISE if n in text], (log.name, text[-2000:])
    # What a notebook does after training: DeepSpeed loaded, the run's adapter loaded (peft).
    code = ("import workbench, deepspeed\n"
            "from workbench.serve.infer import load_chat_model\n"
            f"load_chat_model(workbench.get_job({finished_run.id!r}))\n"
            "load_chat_model('builtin:tiny-llama')\n"
            "print('loaded')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "default"}, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert not [n for n in NOISE if n in output], output[-3000:]
    # A small model loads in a second: no progress bar above the notebook's next output.
    assert "Loading weights" not in output, output[-3000:]


def test_eval_every_zero_means_only_at_the_end_and_negative_is_refused() -> None:
    assert workbench.RunSpec(train={"eval_every": 0}).train.eval_every == 0
    with pytest.raises(SpecError, match="train.eval_every"):
        workbench.RunSpec.parse({"train": {"eval_every": -1}})
