"""The GPU check's smoke mode, run for real on CPU so `make gpu-check` cannot rot unseen (the GPU
figures themselves need a GPU; this checks every measurement is made and is plausible), and the
published reference runs' part of it (bench/gpu_published.py) in its CPU dry run: the same code
with a tiny model, the rows still planned as published."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
PUBLISHED = SCRIPT.with_name("gpu_published.py")


@pytest.mark.slow  # real training of the tiny model, in the check's own process
def test_smoke_mode_measures_everything_on_cpu(tmp_path, wb_home):
    out = tmp_path / "check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path even on a GPU machine
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["precision"]["load"] == "float32"
    for mode in ("padded", "packed"):
        lora = r["lora"][mode]
        assert lora["tokens_per_s"] > 0 and 0 < lora["mfu"] < 1
        assert 0 < lora["last_loss"] < 20  # a finite cross-entropy over a 32k-or-less vocabulary
    mem = r["memory"]
    # The planner's host-RAM estimate of a tiny CPU run is within a factor 3 of the process's
    # peak RSS while it trains (both are dominated by torch + transformers imported: ~0.5 GiB);
    # the planner's own work before it (a fresh home's calibration) is not a training process's.
    assert 1 / 3 < mem["planned_over_measured"] < 3, mem
    snap = r["snapshot"]
    assert snap["state_bytes"] > 0 and snap["sync_save_s"] > 0
    assert snap["stall_s"] >= 0
    assert snap["async_equals_sync"]  # the background writer wrote the same weights
    assert "wrote" in done.stdout
    # The ordinary launch path ran the built-in run to the end (on a GPU: billed from the lease).
    assert r["launched"]["state"] == "succeeded", r["launched"]
    # Liger's side by side needs CUDA: on CPU it says why it was skipped instead of a figure.
    assert "CUDA" in r["liger"]["skipped"] and "liger_over_plain" not in r["liger"]
    # The published rows ran in their own process, in their dry run, beside this JSON.
    pub = r["published"]
    assert pub["rc"] == 0, pub["stderr_tail"]
    assert Path(pub["json"]) == tmp_path / "gpu_published-dry-run.json"
    assert json.loads(Path(pub["json"]).read_text())["dry_run"] is True
    assert len(pub["rows"]) == 6 and all(line in done.stdout for line in pub["rows"])


def test_side_by_side_alternates_the_order_every_round(monkeypatch):
    """The alternation itself, with two counting variants (no model needed to check the order)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_check import alternate

    calls = []
    speeds = {"plain": iter([10.0, 30.0, 20.0]), "liger": iter([15.0, 45.0, 14.0])}

    def variant(name):
        return lambda: calls.append(name) or next(speeds[name])

    r = alternate({"plain": variant("plain"), "liger": variant("liger")}, rounds=3)
    assert calls == ["plain", "liger", "liger", "plain", "plain", "liger"] == r["order"]
    assert r["tokens_per_s"] == {"plain": [10.0, 30.0, 20.0], "liger": [15.0, 45.0, 14.0]}
    assert r["median_tokens_per_s"] == {"plain": 20.0, "liger": 15.0}


def _published(monkeypatch):
    monkeypatch.syspath_prepend(str(PUBLISHED.parent))
    import gpu_published

    return gpu_published


def test_the_published_rows_dry_run_records_planned_measured_and_published(
        tmp_path, wb_home, monkeypatch, capsys):
    """The dry run plans every row for an RTX 4090 (the card three of them ran on) and runs the
    ones that fit with the tiny model on CPU through the code that runs them on a GPU."""
    gp = _published(monkeypatch)
    out = tmp_path / "published.json"
    assert gp.main(["--cpu-dry-run", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["gpu_type"] == "RTX 4090" and r["cards"] == 1
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == [ref.name for ref in gp.REFERENCES]
    for name in ("8B LoRA, 1x RTX 4090", "8B QLoRA, 1x RTX 4090", "8B full, 1x RTX 4090"):
        row = rows[name]
        assert "skipped" not in row and "error" not in row, row
        planned, measured = row["planned"], row["measured"]
        assert planned["peak_gib"] > planned["peak_torch_gib"] > 4, planned
        kind = name.split()[1].strip(",").lower()  # lora, qlora, full
        assert planned["tokens_per_s"] > 0 and planned["strategy"].startswith(f"{kind} + ddp")
        assert measured["model"] == "builtin:tiny-llama" and measured["steps"] == 2
        assert measured["tokens_per_s"] > 0 and 0 < measured["last_loss"] < 20
        assert measured["memory"]["process_peak_rss_gib"] > 0  # no CUDA counters on CPU
        assert row["published"]["note"] is None  # planned for the card it was published on
    full = rows["8B full, 1x RTX 4090"]
    assert full["planned"]["strategy"] == ("full + ddp + paged 8-bit adamw in backward, "
                                           "bf16 weights")
    assert any("torch AdamW for paged_adamw_8bit" in n for n in full["measured"]["notes"])
    assert any("4-bit" in n for n in rows["8B QLoRA, 1x RTX 4090"]["measured"]["notes"])
    # The A6000 rows (no checkpointing) do not fit 24 GB; the 70B row needs 8 cards.
    for name in ("8B LoRA, 1x RTX A6000", "8B full, 1x RTX A6000"):
        assert rows[name]["skipped"].startswith("the plan does not fit a RTX 4090"), rows[name]
        assert "measured" not in rows[name] and rows[name]["planned"]["peak_gib"] > 24
        assert "the card differs" in rows[name]["published"]["note"]
    assert rows["70B LoRA, 8x A100"]["skipped"] == "needs 8 GPUs on one node; this machine lends 1"
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and lines[-1] == f"wrote {out}"
    assert lines[0].startswith("8B LoRA, 1x RTX 4090: planned 18.1 GiB torch")


def test_rows_a_card_cannot_run_are_skipped_with_the_reason(wb_home, monkeypatch):
    """On a 16 GB T4 only QLoRA fits; the full rows' bf16 weights need a bf16 card."""
    gp = _published(monkeypatch)
    chosen = {row.name: (p, why) for row, _, p, why in gp.choose(gp.REFERENCES, "T4", 1)}
    assert chosen["8B QLoRA, 1x RTX 4090"][1] is None
    assert chosen["8B LoRA, 1x RTX 4090"][1].startswith("the plan does not fit a T4")
    for name in ("8B full, 1x RTX 4090", "8B full, 1x RTX A6000"):
        p, why = chosen[name]
        assert p is None and why.startswith("the setup cannot run on a T4") and \
            "master_weights" in why, why
    assert chosen["70B LoRA, 8x A100"] == (None, "needs 8 GPUs on one node; this machine lends 1")
