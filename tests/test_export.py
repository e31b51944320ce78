"""Export (workbench/serve/export_run.py): the quickstart-like run taken home as merged weights, GGUF
files and an Ollama Modelfile, each loaded by the real tool (transformers; llama.cpp through
llama-cpp-python, built by `make export-deps`) and compared token by token with the trained model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.errors import ExportError
from workbench.serve import export_run as ex
from workbench.serve import gguf as g


def _prompt_ids(tok, prompts):
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


# The export runs in a process of its own so that its peak memory (its own and its largest
# child's, from getrusage) and its time can be compared with the plan's.
_MEASURE = """
import json, resource, sys, time
from workbench.serve.export_run import export
lines = []
t0 = time.time()
report = export(sys.argv[1], ["merged", "gguf", "ollama"], quant=["f16", "q8_0", "q4_k_m"],
                out=sys.argv[2], progress=lambda m: lines.append([round(time.time() - t0, 2), m]))
print("RESULT " + json.dumps({"report": report.to_dict(), "lines": lines,
      "seconds": time.time() - t0,
      "self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
      "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


@pytest.fixture(scope="module")
def exported(served_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    plan = served_run.export(["merged", "gguf", "ollama"], quant=["f16", "q8_0", "q4_k_m"],
                             plan_only=True)
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, served_run.id, str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    wall = time.time() - started
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads(line[len("RESULT "):])
    measured["wall"] = wall
    r = measured["report"]
    report = ex.ExportReport(r["run_id"], {k: Path(v) for k, v in r["folders"].items()},
                             r["checks"], r["seconds"])
    return served_run, report, out, plan, measured
def test_merged_gives_the_same_greedy_tokens_as_base_plus_adapter(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.serve.infer import load_chat_model

    job, report, out, *_ = exported
    merged = out / "merged"
    assert report.folders["merged"] == merged
    assert (merged / "model.safetensors").is_file() and (merged / "chat_template.jinja").is_file()
    prompts = ex.run_prompts(job.run_dir.path)
    tok = AutoTokenizer.from_pretrained(str(merged))
    ids = _prompt_ids(tok, prompts)
    trained = ex._greedy(load_chat_model(job).model, ids, 16, tok.eos_token_id)
    mine = ex._greedy(AutoModelForCausalLM.from_pretrained(str(merged)).eval(), ids, 16,
                      tok.eos_token_id)
    assert mine == trained
    assert any(trained)  # the run answers something: the comparison is not of empty lists
    assert tok.decode(trained[0], skip_special_tokens=True).strip() == "moo"


def test_f16_gguf_in_llama_cpp_matches_transformers(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job, report, out, *_ = exported
    tok = AutoTokenizer.from_pretrained(str(out / "merged"))
    prompts = ex.run_prompts(job.run_dir.path)
    ids = _prompt_ids(tok, prompts)
    ref = ex._greedy(AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval(), ids, 16,
                     tok.eos_token_id)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    got = g.generate(out / "gguf" / "model-f16.gguf", ids, 16, texts=texts)
    assert got["tokens"] == ref
    assert got["tokenised"] == ids  # llama.cpp's tokenizer reads the prompts as transformers does
    # The quantised files are checked too; their agreement is recorded, not required.
    checks = {c["file"]: c for c in report.checks}
    assert set(checks) == {"merged/", "gguf/model-f16.gguf", "gguf/model-q8_0.gguf",
                           "gguf/model-q4_k_m.gguf"}
    assert checks["gguf/model-f16.gguf"]["token_agreement"] == 1.0
    for name in ("q8_0", "q4_k_m"):
        assert 0.0 <= checks[f"gguf/model-{name}.gguf"]["token_agreement"] <= 1.0
    assert (out / "gguf" / "model-q4_k_m.gguf").stat().st_size < (
        out / "gguf" / "model-f16.gguf").stat().st_size


def test_card_modelfile_and_status_say_what_was_done(exported):
    job, report, out, *_ = exported
    card = (out / "gguf" / "README.md").read_text()
    for text in ("builtin:tiny-llama", "lora", "builtin:teaching", "180 rows", "heldout",
                 "reproduce bundle", "model-q4_k_m.gguf", "llama.cpp"):
        assert text in card, text
    assert "base + adapter" in (out / "merged" / "README.md").read_text()
    modelfile = (out / "gguf" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-q4_k_m.gguf\n")
    assert 'PARAMETER stop "<|end|>"' in modelfile and "<|assistant|>" in modelfile
    record = json.loads((out / "gguf" / "export.json").read_text())
    assert record["format"] == "gguf + ollama" and len(record["checks"]) == 3
    status = job.status()["export"]
    assert status["folders"]["gguf"] == str(out / "gguf") and len(status["checks"]) == 4
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_refused_before_any_work(served_run, tmp_path, monkeypatch):
    with pytest.raises(ExportError, match="unknown export format zip"):
        ex.export(served_run, ["zip"], out=tmp_path)
    with pytest.raises(ExportError, match="unknown GGUF type q9"):
        ex.export(served_run, ["gguf"], quant=["q9"], out=tmp_path)
    odd = tmp_path / "odd-model"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ExportError, match="cannot convert NoSuchForCausalLM"):
        g.check_convertible(odd)
    monkeypatch.setattr(ex, "base_dir", lambda art: odd)  # the run's base: that architecture
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="not among its .* architectures"):
        ex.export(served_run, ["gguf"], out=out, progress=False)
    assert not out.exists() or not any(out.iterdir())


def test_a_failure_leaves_no_half_written_export(served_run, tmp_path, monkeypatch):
    def broken(src, dst, qtype, progress=None):
        dst.write_bytes(b"partial")
        raise ExportError("quantiser died")

    monkeypatch.setattr(g, "quantize", broken)
    with pytest.raises(ExportError, match="quantiser died"):
        ex.export(served_run, ["merged", "gguf"], quant=["f16", "q4_k_m"], out=tmp_path,
                  progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_merged(served_run, tmp_path, capsys):
    from workbench.cli import main

    assert main(["export", served_run.id, "--format", "merged", "--out", str(tmp_path)]) == 0
    assert "merged/: 8/8 prompts identical" in capsys.readouterr().out
    assert (Path(tmp_path) / "merged" / "README.md").is_file()


# -- the plan: disk, memory and time, against what the export measured ---------------------------

def _written(folder: Path) -> dict[str, int]:
    """Bytes of every file under ``folder`` by relative path (os.walk: the oracle for disk)."""
    out = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = Path(top) / name
            out[str(path.relative_to(folder))] = path.stat().st_size
    return out


def test_plan_disk_is_within_ten_percent_of_the_bytes_written(exported):
    job, report, out, plan, measured = exported
    written = _written(out)
    got = {}
    for name, planned in plan.files.items():
        got[name] = sum(v for k, v in written.items() if k == name or k.startswith(name))
        assert abs(planned - got[name]) <= 0.10 * got[name], (name, planned, got[name])
    total = sum(written.values())
    assert abs(sum(plan.files.values()) - total) <= 0.10 * total, (plan.files, total)
    # Everything was kept (f16 was asked for), so the peak on disk is what stays.
    assert plan.disk_bytes == sum(plan.files.values())
    print(f"\nplanned disk {plan.disk_bytes} B, written {total} B; " + ", ".join(
        f"{k} {v} B planned, {got[k]} B written" for k, v in plan.files.items()))


def test_plan_memory_and_time_bound_what_the_export_used(exported):
    """Peak resident memory of the export's process (getrusage, the process that merged and
    checked) and of its largest child (converter, quantiser, llama.cpp check): the plan is at
    least the first and at most their sum (both at once), within 20%; the time is in its range
    (with room for a loaded machine)."""
    job, report, out, plan, measured = exported
    main_b, child_b = measured["self_kb"] * 1024, measured["children_kb"] * 1024
    assert 0.8 * main_b <= plan.memory_bytes <= 1.2 * (main_b + child_b), (
        plan.memory_bytes, main_b, child_b)
    lo, hi = plan.seconds_range
    # The plan is for a machine doing nothing else; the suite shares its cores with other jobs,
    # so the top of the range gets twice the room (beyond that the plan is wrong, not the load).
    assert lo <= measured["seconds"] <= 2 * hi, (plan.seconds_range, measured["seconds"])
    first = measured["lines"][0][1]
    assert first.startswith(f"export of {job.id} on this machine: needs about ") and (
        plan.headline() in first)
    print(f"\nplanned memory {plan.memory_bytes / 1e9:.2f} GB; peak RSS export process "
          f"{main_b / 1e9:.2f} GB, largest child {child_b / 1e9:.2f} GB; planned "
          f"{plan.seconds:.1f} s ({lo:.1f}-{hi:.1f}), took {measured['seconds']:.1f} s; "
          f"steps planned {plan.steps}; lines {measured['lines']}")


def test_plan_is_shown_without_work_and_refuses_short_disk(served_run, tmp_path, monkeypatch,
                                                          capsys):
    from workbench.cli import main

    out = tmp_path / "out"
    assert main(["export", served_run.id, "--format", "merged,gguf", "--quant", "q8_0",
                 "--out", str(out), "--plan"]) == 0
    text = capsys.readouterr().out
    assert f"export of {served_run.id} on this machine: needs about" in text
    assert "gguf/model-q8_0.gguf" in text and "merged/" in text and not out.exists()
    plan = served_run.export(["merged"], plan_only=True)
    assert set(plan.files) == {"merged/"} and "<table>" in plan._repr_html_()
    # float16 halves the merged weights (the tokenizer files stay as they are).
    half = served_run.export(["merged"], dtype="float16", plan_only=True)
    assert half.files["merged/"] < 0.6 * plan.files["merged/"]

    class Usage:
        free = plan.disk_bytes  # less than the plan's figure with its margin
    monkeypatch.setattr(ex.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ExportError, match=r"needs about .*B of disk in .* \(its plan: needs "
                                          r"about .* but .* is free; pass out="):
        ex.export(served_run, ["merged"], out=out, progress=False)
    assert not out.exists() or not any(out.iterdir())


def test_plan_counts_from_plan_json_when_the_base_is_only_on_the_target(served_run, monkeypatch):
    """A base this machine cannot read (a run's remote target has it): the parameter count the
    run's plan.json recorded stands in for the tensor shapes, and the sizes stay near."""
    from workbench.errors import ModelNotFoundError
    from workbench.serve import export_plan

    shaped = served_run.export(["merged", "gguf"], quant=["f16"], plan_only=True)

    def elsewhere(art):
        raise ModelNotFoundError("only on the target")

    monkeypatch.setattr(export_plan, "base_dir", elsewhere)
    counted = served_run.export(["merged", "gguf"], quant=["f16"], plan_only=True)
    assert "plan.json" in counted.basis and "safetensors headers" in shaped.basis
    recorded = json.loads((served_run.run_dir.path / "plan.json").read_text())["params"]
    assert counted.params == recorded and abs(recorded - shaped.params) <= 0.01 * shaped.params
    for name, size in shaped.files.items():
        assert abs(counted.files[name] - size) <= 0.05 * size, (name, counted.files[name], size)
