"""What a sweep optimises, read from a trial's run directory.

``eval_loss`` is the run's validation loss from metrics.jsonl (one value per evaluation step;
the final one is the last). ``eval.<task>.<metric>`` is a score from the run's eval.jsonl through
:mod:`workbench.evaluate.results` (intermediate values from lines scored during training, the
final one from :func:`~workbench.evaluate.results.flat`).

    >>> Objective.parse("eval.heldout.rouge_l").direction
    'maximize'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import SweepError
from workbench.runs.rundir import RunDir

_EVAL_RE = re.compile(r"eval\.([A-Za-z0-9_:\-]+)\.([A-Za-z0-9_\-]+)")
# Metric names that are better when smaller; any other score is taken as better when larger.
_LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "wer", "cer")


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str  # "minimize" | "maximize"
    task: str | None = None
    metric: str | None = None

    @classmethod
    def parse(cls, name: str, direction: str | None = None) -> Objective:
        if direction is not None and direction not in ("minimize", "maximize"):
            raise SweepError(f"direction must be 'minimize' or 'maximize', not {direction!r}")
        if name == "eval_loss":
            return cls(name, direction or "minimize")
        m = _EVAL_RE.fullmatch(name)
        if m is None:
            raise SweepError(
                f"objective {name!r} is not one a run reports: use 'eval_loss' (the validation "
                f"loss in metrics.jsonl) or 'eval.<task>.<metric>' from eval.jsonl, e.g. "
                f"'eval.heldout.rouge_l'")
        task, metric = m.groups()
        lower = any(word in metric.lower() for word in _LOWER_IS_BETTER)
        return cls(name, direction or ("minimize" if lower else "maximize"), task, metric)

    def intermediate(self, run_dir: str | Path) -> list[tuple[int, float]]:
        """(step, value) at each evaluation during training, in order."""
        if self.task is None:
            return [(int(m["step"]), float(m["eval_loss"])) for m in RunDir(run_dir).metrics()
                    if "eval_loss" in m and "event" not in m and "step" in m]
        from workbench.evaluate import results

        return [(int(line["step"]), float(line["metrics"][self.metric]))
                for line in results.read(run_dir)
                if line.get("task") == self.task and self.metric in line.get("metrics", {})
                and line.get("phase") == "during"]

    def final(self, run_dir: str | Path) -> float | None:
        """The value that ranks the trial once its run ended (None when it never reported one)."""
        if self.task is None:
            points = self.intermediate(run_dir)
            return points[-1][1] if points else None
        from workbench.evaluate import results

        lines = [line for line in results.read(run_dir) if line.get("model", "run") == "run"]
        value = results.flat(lines).get(f"{self.task}.{self.metric}")
        return None if value is None else float(value)

    def reported(self, run_dir: str | Path) -> list[str]:
        """What the run did report, for an error that says what could be used instead."""
        names = ["eval_loss"] if RunDir(run_dir).metrics() and any(
            "eval_loss" in m for m in RunDir(run_dir).metrics()) else []
        from workbench.evaluate import results

        names += [f"eval.{k}" for k in results.flat(results.read(run_dir))]
        return names
