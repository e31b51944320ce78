"""The GPU check's smoke mode, run for real on CPU so `make gpu-check` cannot rot unseen (the GPU
figures themselves need a GPU; this checks every measurement is made and is plausible)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


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
    # The planner's host-RAM estimate of a tiny CPU run is within a factor 3 of the measured RSS
    # (both are dominated by torch + transformers imported: ~0.5 GiB).
    assert 1 / 3 < mem["planned_over_measured"] < 3, mem
    snap = r["snapshot"]
    assert snap["state_bytes"] > 0 and snap["sync_save_s"] > 0
    assert snap["stall_s"] >= 0
    assert snap["async_equals_sync"]  # the background writer wrote the same weights
    assert "wrote" in done.stdout
    # Liger's side by side needs CUDA: on CPU it says why it was skipped instead of a figure.
    assert "CUDA" in r["liger"]["skipped"] and "liger_over_plain" not in r["liger"]


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
