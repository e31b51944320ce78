"""A vision-language run through launch(): the built-in tiny Qwen2-VL trains a LoRA on the built-in
picture questions in 2 real processes, and what the vision path cannot take is refused.

How it tests: the run is the notebook's own call, ``workbench.launch(spec)``, ended by its
supervisor; that the loss fell is read from the run's metrics.jsonl on disk (what the ranks'
callback wrote), not from what status() reports; the adapter is checked by its files and
its config (which modules it adapted). Each refusal is a real launch of a bad spec or bad files
(a missing image, a cut PNG, text named .png), checked for its one-line typed message and for
leaving no run directory and no registry entry behind.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

import workbench
from workbench.errors import DatasetError, DatasetFormatError, ImageDataError
from workbench.evaluate import results
from workbench.runs.home import runs_dir
from workbench.runs.registry import Registry

VISION = {"name": "vision", "model": {"id": "builtin:tiny-qwen2-vl"},
          "data": {"sources": [{"path": "builtin:teaching-images"}]},
          "resources": {"processes_per_node": 2}}


def _lines(run_dir, key: str) -> list[float]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_a_vlm_trains_a_language_lora_in_two_processes_and_its_loss_falls():
    planned = workbench.plan(VISION)  # before the run, as a user sees it
    job = workbench.launch(VISION)
    state = job.wait(timeout=240, progress=False)
    status = job.status()
    assert state == "succeeded", status.get("error")
    assert status["world_size"] == 2
    assert status["data"]["train"] > 0
    run_dir = job.run_dir.path
    losses, evals = _lines(run_dir, "loss"), _lines(run_dir, "eval_loss")
    assert len(losses) == status["step"] >= 5, losses
    # One epoch of a few steps: a step's loss depends on which questions its batch drew, so the
    # training loss is compared over thirds; the validation loss (the same rows every time) is
    # the clean signal and falls at every evaluation.
    third = max(1, len(losses) // 3)
    first, last = sum(losses[:third]) / third, sum(losses[-third:]) / third
    assert last < first, f"training loss did not fall: {losses}"
    assert len(evals) >= 3, evals
    assert all(b <= a for a, b in zip(evals, evals[1:])), f"validation loss rose: {evals}"
    assert evals[-1] < evals[0] - 0.1, f"validation loss barely fell: {evals}"
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "preprocessor_config.json").is_file()  # the processor, to load it back
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "language_model" in targets and "visual" not in targets, targets
    # The default eval: (heldout after training) is not scored by an image model's run, and
    # its plan prices no scoring and says why; the log says so too.
    assert not (run_dir / results.FILE).exists()
    assert planned.clock["scoring_s"] == 0 and "none in the run" in planned.clock["scoring"]
    assert "not scored in this run" in job.logs(tail=None)
    # The plan's memory per process against each rank's measured peak RSS (issue 39: 15 %).
    peaks = [json.loads(f.read_text())["peak_gib"]
             for f in job.run_dir.logs_dir.glob("memory-rank-*.json")]
    assert len(peaks) == 2 and abs(planned.memory.total / max(peaks) - 1) <= 0.15, (
        planned.memory.total, peaks)


def _picture_rows(folder: Path, second: str) -> Path:
    """Two messages rows: a good picture, then ``second``."""
    buf = io.BytesIO()
    Image.new("RGB", (84, 84), "red").save(buf, format="PNG")
    (folder / "good.png").write_bytes(buf.getvalue())
    path = folder / "pictures.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "image": name},
                                     {"type": "text", "text": "What colour is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}) + "\n"
        for name in ("good.png", second)), encoding="utf-8")
    return path


def _missing(folder: Path) -> dict:
    return {"sources": [{"path": str(_picture_rows(folder, "gone.png"))}]}


def _cut_png(folder: Path) -> dict:
    buf = io.BytesIO()
    Image.effect_noise((84, 84), 60).convert("RGB").save(buf, format="PNG")
    (folder / "cut.png").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    return {"sources": [{"path": str(_picture_rows(folder, "cut.png"))}]}


def _text_named_png(folder: Path) -> dict:
    (folder / "list.png").write_text("eggs, milk, bread\n", encoding="utf-8")
    return {"sources": [{"path": str(_picture_rows(folder, "list.png"))}]}


def _packed(folder: Path) -> dict:
    return {**VISION["data"], "packing": True}


def _pictures(folder: Path) -> dict:
    return VISION["data"]


TEXT_MODEL: dict = {}  # the default model: the built-in tiny text model


def _text_with_pixel_cap(folder: Path) -> dict:
    return {"sources": [{"path": "builtin:teaching"}], "image_max_pixels": 3136}


@pytest.mark.parametrize("model, data, error, says", [
    (VISION["model"], _packed, DatasetError, ["vision-language model", "data.packing: false"]),
    (TEXT_MODEL, _pictures, DatasetFormatError,
     ["holds an image, which a text model cannot read", "model.id: builtin:tiny-qwen2-vl"]),
    (VISION["model"], _missing, ImageDataError,
     ["line 2 of pictures.jsonl", "gone.png not found"]),
    (VISION["model"], _cut_png, ImageDataError,
     ["line 2 of pictures.jsonl", "cut.png is not a readable image", "replace the file"]),
    (VISION["model"], _text_named_png, ImageDataError,
     ["line 2 of pictures.jsonl", "list.png is not a readable image (not an image file)"]),
    (TEXT_MODEL, _text_with_pixel_cap, DatasetError,
     ["image_max_pixels size the images", "builtin:tiny-llama reads text only; remove them"]),
], ids=["vlm-packing", "text-model-images", "missing-image", "cut-image",
        "text-named-png", "text-model-pixel-cap"])
def test_what_the_vision_path_cannot_take_is_refused_in_one_line_leaving_nothing(
        tmp_path, model, data, error, says):
    before_runs, before_reg = set(runs_dir().iterdir()), len(Registry().list_runs())
    spec = {**VISION, "model": model, "data": data(tmp_path)}
    with pytest.raises(error) as info:
        workbench.launch(spec)
    message = str(info.value)
    assert "\n" not in message, message
    assert all(s in message for s in says), message
    assert set(runs_dir().iterdir()) == before_runs
    assert len(Registry().list_runs()) == before_reg


def test_qlora_of_a_vlm_is_refused_before_planning():
    """On a CPU machine the backend refuses QLoRA first (no bitsandbytes): the vision path's own
    refusal, which a GPU launch meets, is the check launch makes before planning."""
    from workbench.data.vision import check_vision_spec
    from workbench.spec import RunSpec

    with pytest.raises(DatasetError) as info:
        check_vision_spec(RunSpec(**{**VISION, "method": {"kind": "qlora"}}))
    message = str(info.value)
    assert "\n" not in message and "method.kind: lora" in message, message


@pytest.mark.slow
def test_a_vlm_run_killed_mid_way_resumes_step_for_step(tmp_path):
    """Rank 1 of a 2-process VLM run is killed -9 once a step past its snapshot is logged (the run
    holds there); the automatic restart resumes from the snapshot, and the steps trained twice,
    before the kill and after the resume, come out the same."""
    from tests.preference_runs import ONE_SNAPSHOT, kill_rank_1_and_resume, launch_held

    steps, every = 8, ONE_SNAPSHOT["every_steps"]
    spec = {**VISION, "name": "vision-kill", "checkpoint": ONE_SNAPSHOT,
            "train": {"max_steps": steps, "lr": 3e-3}, "eval": {"after": False}}
    job, hold = launch_held(spec, every + 1, tmp_path)
    at = kill_rank_1_and_resume(job, hold, steps, every, past=True)
    raw = [m for m in job.run_dir.metrics() if "loss" in m or m.get("event") == "resume"]
    cut = next(i for i, m in enumerate(raw) if m.get("event") == "resume")
    first = {m["step"]: m["loss"] for m in raw[:cut] if "loss" in m}
    again = {m["step"]: m["loss"] for m in raw[cut + 1:]}
    twice = [s for s in first if s > at]
    assert twice, (at, sorted(first))
    for s in twice:
        assert again[s] == pytest.approx(first[s], rel=1e-4, abs=1e-5), (s, first, again)
