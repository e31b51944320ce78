"""The record of evaluations: ``eval.jsonl`` in the run directory, one line per (task, model, step).

This file is the contract between whoever scores (the evaluator on the run's target, ``job.evaluate``,
``workbench eval``) and whoever reads (the job view, ``workbench.compare``, sweeps, the panel):

    {"time": 1764600000.0,          # when the scores were recorded (epoch seconds)
     "phase": "before",             # before | during | after | manual
     "step": 0,                     # training step the scored weights come from (0: the base model)
     "model": "base",               # base | run | endpoint:NAME
     "task": "heldout",             # heldout | perplexity | judge | lm_eval:TASK
     "metrics": {"rouge_l": 0.41, "exact_match": 0.25},   # name -> number (higher or lower: see name)
     "n": 64,                       # examples scored
     "examples": "eval/before-0-heldout.jsonl"}           # optional: per-example rows, run-relative

Optional keys a reader may meet (added compatibly; readers ignore what they do not know):
``"seconds"`` (how long the task took to score), ``"baseline"`` (judge lines: ``base`` when the
win rate is against the base model's answers, ``reference`` when against the file's answers).
Writers: :mod:`workbench.evaluate.runner` (every evaluation: the training callback,
``job.evaluate``, ``workbench eval``); status.json also gets ``eval_error`` when an in-run
evaluation failed (training went on).

``flat()`` turns the newest line of each (task, metric) into status.json's ``eval`` mapping,
``{"heldout.rouge_l": 0.41, ...}``; ``read()`` is tolerant of a half-written last line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from workbench.runs.rundir import MetricsReader

PHASES = ("before", "during", "after", "manual")
FILE = "eval.jsonl"
EXAMPLES_DIR = "eval"


def record(task: str, metrics: dict[str, float], *, phase: str, step: int, n: int,
           model: str = "run", examples: str | None = None) -> dict[str, Any]:
    """One eval.jsonl line, checked: a typo in a phase or a non-number metric fails here."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise ValueError(f"metrics must be numbers; got {bad}")
    line: dict[str, Any] = {"time": time.time(), "phase": phase, "step": int(step), "model": model,
                            "task": task, "metrics": {k: float(v) for k, v in metrics.items()},
                            "n": int(n)}
    if examples:
        line["examples"] = examples
    return line


def append(run_dir: str | Path, line: dict[str, Any]) -> None:
    """Append one line (one write, so a reader never sees half of it except at the very end)."""
    path = Path(run_dir) / FILE
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
        fh.flush()


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a run's eval.jsonl (an empty list before the first evaluation)."""
    return MetricsReader(Path(run_dir) / FILE).read_new()


def flat(lines: list[dict[str, Any]]) -> dict[str, float]:
    """The newest value of each ``task.metric`` (what status.json's ``eval`` holds)."""
    out: dict[str, float] = {}
    for line in lines:
        for name, value in line.get("metrics", {}).items():
            out[f"{line['task']}.{name}"] = value
    return out
