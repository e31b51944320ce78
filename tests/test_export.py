"""Export (workbench/serve/export_run.py): the quickstart-like run taken home as merged weights, GGUF
files and an Ollama Modelfile, each loaded by the real tool (transformers; llama.cpp through
llama-cpp-python, built by `make export-deps`) and compared token by token with the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.errors import ExportError
from workbench.serve import export_run as ex
from workbench.serve import gguf as g


def _prompt_ids(tok, prompts):
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def exported(served_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    report = served_run.export(["merged", "gguf", "ollama"], quant=["f16", "q8_0", "q4_k_m"],
                               out=out, progress=False)
    return served_run, report, out


def test_merged_gives_the_same_greedy_tokens_as_base_plus_adapter(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.serve.infer import load_chat_model

    job, report, out = exported
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

    job, report, out = exported
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
    job, report, out = exported
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
    monkeypatch.setattr(ex, "_base_dir", lambda art: odd)  # the run's base: that architecture
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
