"""Activation memory is sized by the data's longest batch, not by max_length for every batch.

A padded batch is as long as its longest example, so that (capped by max_length; max_length
itself when packed) bounds what a step can need. The plan says which length it used and what it
was measured on; a sample that missed longer rows is corrected at launch, which measures them all.
"""

from __future__ import annotations

import json

import pytest

import workbench
from workbench.plan import plan


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_a_7b_lora_on_short_examples_is_not_planned_as_if_every_batch_were_max_length():
    # The built-in teaching rows are a few dozen tokens; max_length is 256 by default.
    spec = workbench.RunSpec(model={"id": "meta-llama/Llama-2-7b-hf"}, train={"max_steps": 50},
                             resources={"gpus_per_node": 1, "gpu_type": "T4"})
    short = plan(spec)
    packed = plan(spec.updated(**{"data.packing": True}))  # packed blocks are max_length long
    assert short.memory_seq_len < spec.data.max_length == packed.memory_seq_len
    assert short.memory.activations < packed.memory.activations
    assert any("activations sized at" in a and "longest example" in a for a in short.assumptions)


def test_a_long_row_the_sample_missed_is_sized_for_at_launch(tmp_path):
    # 600 one-word answers, then one long one: the plan's sample (the first rows) cannot see it.
    rows = [{"instruction": f"Say the number {i}.", "input": "", "output": str(i)} for i in range(600)]
    long_text = " ".join(f"word{i}" for i in range(150))
    rows.append({"instruction": "Repeat after me: " + long_text, "input": "", "output": "ok"})
    spec = workbench.RunSpec(name="longest-row", data={
        "sources": [{"path": _rows(tmp_path / "rows.jsonl", rows)}], "validation_fraction": 0,
        "max_length": 256}, train={"max_steps": 1})
    sampled = plan(spec)
    assert any("first" in a and "launch re-checks" in a for a in sampled.assumptions)
    job = workbench.launch(spec)
    try:
        planned = json.loads(job.run_dir.plan_file.read_text())
        longest = planned["data_tokens"]["splits"]["train"]["tokens"]["max"]
        assert planned["memory_seq_len"] == min(longest, 256) > sampled.memory_seq_len
        assert planned["memory_gib"]["activations"] > sampled.memory.activations
        assert any("every training row" in a for a in planned["assumptions"])
    finally:
        job.cancel(timeout=120)


@pytest.mark.parametrize("longest", [1, 64, 256, 10_000])
def test_activations_grow_with_the_longest_example_and_stop_at_max_length(longest):
    spec = workbench.RunSpec(train={"max_steps": 5})
    p = plan(spec, longest=longest)
    assert p.memory_seq_len == min(longest, spec.data.max_length)
    if longest > 1:
        assert p.memory.activations > plan(spec, longest=1).memory.activations
