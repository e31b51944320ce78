"""The planner counts a model's shape from config.json without torch or transformers, and gets
what the meta-device instance through transformers gets, for every family it counts.

The configs below are written by hand for this test (odd sizes, grouped-query attention, an
explicit head_dim that is not hidden/heads, biases on and off, tied and untied embeddings), so a
layer the arithmetic forgets or counts twice shows up as a difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.plan.shape import OFFLINE_CONFIGS, counted_shape, meta_shape, model_shape

CONFIGS = {
    "llama-gqa-bias": dict(model_type="llama", hidden_size=96, num_hidden_layers=3,
                           num_attention_heads=6, num_key_value_heads=2, vocab_size=500,
                           intermediate_size=200, attention_bias=True, mlp_bias=True,
                           tie_word_embeddings=False),
    "mistral-head-dim-tied": dict(model_type="mistral", hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  vocab_size=300, intermediate_size=160,
                                  tie_word_embeddings=True),
    "qwen2-one-kv-head": dict(model_type="qwen2", hidden_size=80, num_hidden_layers=2,
                              num_attention_heads=5, num_key_value_heads=1, vocab_size=256,
                              intermediate_size=192, tie_word_embeddings=True),
    "qwen3-qk-norm": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          vocab_size=320, intermediate_size=128, attention_bias=False,
                          tie_word_embeddings=False),
}


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path_factory.getbasetemp() / "shape-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _folder(tmp_path: Path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIGS[name],
                                                    "architectures": ["ForCausalLM"]}))
    return str(folder)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_config_folder_is_counted_as_transformers_builds_it(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _folder(tmp_path, name)
    counted = model_shape(folder)
    assert counted == meta_shape(folder)
    # The real model (tiny, on the CPU) has as many parameters.
    real = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert counted.params == sum(p.numel() for p in real.parameters())


def test_builtin_and_offline_table_counted_like_the_meta_instance():
    assert model_shape("builtin:tiny-llama") == meta_shape("builtin:tiny-llama")
    for model_id, fields in OFFLINE_CONFIGS.items():
        shape = counted_shape(model_id, dict(fields), "offline table")
        assert shape is not None and shape == meta_shape(model_id), model_id


def test_what_it_cannot_count_goes_through_transformers(tmp_path):
    # A shape field left to the library's default (which differs between versions) and a
    # model_type it does not count: both still planned, from the instantiated model.
    fields = {k: v for k, v in CONFIGS["qwen3-qk-norm"].items() if k != "head_dim"}
    assert counted_shape("x", fields, "config") is None
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
         "n_positions": 128}))
    shape = model_shape(str(tmp_path / "gpt2"))
    assert shape.layers == 2 and shape.vocab == 300 and shape.params > 300 * 64


def test_planning_a_local_model_imports_neither_torch_nor_transformers(tmp_path):
    folder = _folder(tmp_path, "llama-gqa-bias")
    code = (
        "import sys\n"
        "from workbench.runs.launching import _validate_model\n"
        "from workbench.plan.shape import model_shape\n"
        "from workbench.spec import RunSpec\n"
        f"shape = model_shape({folder!r})\n"
        f"_validate_model(RunSpec(model={{'id': {folder!r}}}))\n"
        "print(shape.params, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ}, check=True, timeout=300)
    params, heavy = out.stdout.split(" ", 1)
    assert int(params) == meta_shape(folder).params
    assert heavy.strip() == "[]", out.stdout
