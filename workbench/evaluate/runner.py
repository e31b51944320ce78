"""Run a list of eval tasks on one model source and record the scores (eval.jsonl, status.json).

The one path every evaluation takes: the training run's callback (before / during / after),
``job.evaluate`` and ``workbench.evaluate`` / ``workbench eval`` all call :func:`score`.

    >>> report = evaluate("builtin:tiny-llama", tasks=["heldout"], file="qa.jsonl")  # doctest: +SKIP
    >>> report.metrics                                                          # doctest: +SKIP
    {'heldout.exact_match': 0.0, 'heldout.rouge_l': 0.12, ...}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import EvalError
from workbench.evaluate import results
from workbench.spec.sections import EvalTask

# Per-example rows are kept where small: at most this many per task and evaluation point.
EXAMPLES_KEPT = 64


@dataclass
class EvalReport:
    """What one evaluation produced: eval.jsonl lines and per-example rows, by task."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        return results.flat(self.lines)

    def df(self) -> Any:
        """One row per (task, metric): phase, step, model, task, metric, value, n, and what was
        scored where a task says (perplexity: the answer tokens, as eval_loss)."""
        import pandas as pd

        return pd.DataFrame([{"phase": ln["phase"], "step": ln["step"], "model": ln["model"],
                              "task": ln["task"], "metric": k, "value": v, "n": ln["n"],
                              **({"scored": ln["scored"]} if ln.get("scored") else {})}
                             for ln in self.lines for k, v in ln["metrics"].items()])

    def _repr_html_(self) -> str:
        return str(self.df()._repr_html_())


def as_tasks(tasks: Any, **knobs: Any) -> list[EvalTask]:
    """EvalTasks from kinds ('heldout'), mappings or EvalTasks; ``knobs`` fill unset fields."""
    from pydantic import ValidationError

    from workbench.errors import SpecError
    from workbench.spec.problems import problems

    out = []
    for t in tasks if isinstance(tasks, (list, tuple)) else [tasks]:
        if isinstance(t, EvalTask):
            t = t.model_dump()
        data = {"kind": t} if isinstance(t, str) else dict(t)
        if isinstance(t, str) and t.startswith("lm_eval:"):
            data = {"kind": "lm_eval", "tasks": [t.split(":", 1)[1]]}
        for k, v in knobs.items():
            if v is not None:
                data.setdefault(k, v)
        try:
            out.append(EvalTask.model_validate(data))
        except ValidationError as exc:
            raise SpecError([("eval.tasks." + p if p else "eval.tasks", m)
                             for p, m in problems(exc, EvalTask)]) from None
    return out


def score(source: Any, tasks: list[EvalTask], *, phase: str, step: int,
          run_dir: str | Path | None = None, default_file: str | Path | None = None,
          base_id: str | None = None) -> EvalReport:
    """Score ``source`` on every task; append each line to the run's eval.jsonl as it is known
    (a later task failing keeps the earlier ones) and refresh status.json's ``eval``."""
    report = EvalReport()
    for task in tasks:
        started = time.time()
        for name, metrics, n, rows, extra in _one(source, task, default_file, base_id):
            extra = {**extra, "seconds": round(time.time() - started, 3)}
            rel = None
            if run_dir is not None and rows:
                rel = f"{results.EXAMPLES_DIR}/{phase}-{step}-{_slug(name)}-{_slug(source.label)}"\
                      ".jsonl"
                path = Path(run_dir) / rel
                path.parent.mkdir(exist_ok=True)
                path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n"
                                        for r in rows[:EXAMPLES_KEPT]), encoding="utf-8")
            line = results.record(name, metrics, phase=phase, step=step, n=n,
                                  model=source.label, examples=rel)
            line.update(extra)
            report.lines.append(line)
            report.examples[name] = rows
            if run_dir is not None:
                _write(Path(run_dir), line)
    return report


def _write(run_dir: Path, line: dict[str, Any]) -> None:
    from workbench.runs.rundir import RunDir

    results.append(run_dir, line)
    rd = RunDir(run_dir)
    if rd.status_file.is_file():
        rd.write_status(eval=results.flat(results.read(run_dir)))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def _one(source: Any, task: EvalTask, default_file: str | Path | None, base_id: str | None
         ) -> list[tuple[str, dict[str, float], int, list[dict[str, Any]], dict[str, Any]]]:
    if task.kind == "lm_eval":
        from workbench.evaluate import harness

        return [(name, m, n, rows, {}) for name, m, n, rows in
                harness.run(source, task.tasks, task.max_samples, task.chat_template)]
    file = task.file or default_file
    if file is None and task.kind != "lm_eval":
        raise EvalError(f"the {task.kind} task needs file: (no validation split to fall back on "
                        "here); give a jsonl file of prompts and answers")
    if task.kind == "heldout":
        from workbench.evaluate import heldout

        if getattr(source, "kind", None) == "vision":  # image questions: a VLM's own reader
            from workbench.evaluate import images

            metrics, rows = heldout.run(source, images.load_examples(file, task.max_samples),
                                        task.max_new_tokens, images.describe)
        else:
            metrics, rows = heldout.run(source, heldout.load_examples(file, task.max_samples),
                                        task.max_new_tokens)
        return [("heldout", metrics, len(rows), rows, {})]
    if task.kind == "perplexity":
        from workbench.evaluate import perplexity

        texts = perplexity.load_texts(file, getattr(source, "tokenizer", None), task.max_samples)
        metrics, rows = perplexity.run(source, texts)
        return [("perplexity", metrics, len(rows), rows, {"scored": perplexity.SCORED})]
    return [_judge(source, task, file, base_id)]


def _judge(source: Any, task: EvalTask, file: Any, base_id: str | None
           ) -> tuple[str, dict[str, float], int, list[dict[str, Any]], dict[str, Any]]:
    from workbench.evaluate import heldout, judge
    from workbench.evaluate.sources import open_endpoint

    assert task.judge is not None  # EvalTask's validator
    judge_src = open_endpoint(task.judge, task.judge_model, task.api_key_env, label="judge",
                              concurrency=judge.CONCURRENCY)
    _ = judge_src.model  # an unreachable judge fails here, before any answer is generated
    examples = heldout.load_examples(file, task.max_samples)
    prompts = [m for m, _ in examples]
    refs = [r for _, r in examples]
    evaluated = source.generate(prompts, max_new_tokens=task.max_new_tokens)
    if getattr(source, "base_id", None) is None and base_id:
        from workbench.spec.models import resolve_model

        source.base_id = resolve_model(base_id)
    base = source.baseline()
    baseline = base.generate(prompts, max_new_tokens=task.max_new_tokens) if base else refs
    questions = [m[-1]["content"] for m in prompts]
    metrics, rows = judge.run(judge_src, questions, evaluated, baseline, task.rubric,
                              references=None if base is None else refs)
    return ("judge", metrics, len(rows), rows, {"baseline": "base" if base else "reference"})


def _reach_judges(tasks: list[EvalTask]) -> None:
    """An unreachable judge fails before weights are loaded and answers generated."""
    from workbench.evaluate.sources import open_endpoint

    for t in tasks:
        if t.kind == "judge" and t.judge:
            _ = open_endpoint(t.judge, t.judge_model, t.api_key_env).model


def _open_weights(model: Any, label: str) -> Any:
    """Weights in this process: a vision-language model (or a run of one) with its processor,
    any other with its tokenizer."""
    from workbench.evaluate.images import is_vision, open_vision
    from workbench.evaluate.sources import open_weights

    return open_vision(model, label) if is_vision(model) else open_weights(model, label)


def evaluate(model: Any = None, tasks: Any = ("heldout",), *, endpoint: str | None = None,
             file: str | Path | None = None, max_samples: int | None = None,
             max_new_tokens: int | None = None, judge: str | None = None,
             run_dir: str | Path | None = None, phase: str = "manual", step: int = 0,
             label: str | None = None, concurrency: int | None = None) -> EvalReport:
    """Score a model id/folder (base, adapter, snapshot) or an ``endpoint`` (Workbench endpoint
    name or URL) on ``tasks`` (kinds, mappings or EvalTasks); ``file`` is the heldout/judge/
    perplexity data. With ``run_dir`` the lines also go to that run's eval.jsonl. An endpoint is
    sent up to ``concurrency`` requests at once (default :data:`sources.CONCURRENCY`)."""
    from workbench.evaluate.sources import CONCURRENCY, open_endpoint

    if (model is None) == (endpoint is None):
        raise EvalError("give a model (id, folder, adapter or snapshot) or endpoint=NAME_OR_URL")
    parsed = as_tasks(list(tasks) if not isinstance(tasks, str) else [tasks],
                      file=str(file) if file else None, max_samples=max_samples,
                      max_new_tokens=max_new_tokens, judge=judge)
    _reach_judges(parsed)
    source: Any = (open_endpoint(endpoint, label=label, concurrency=concurrency or CONCURRENCY)
                   if endpoint is not None
                   else _open_weights(model, label=label or "run"))
    return score(source, parsed, phase=phase, step=step, run_dir=run_dir)


def evaluate_run_dir(path: str | Path, tasks: Any = None, *, endpoint: str | None = None,
                     step: int | None = None, **knobs: Any) -> EvalReport:
    """Score the run directory ``path`` in place: its adapter/ or model/ (or ``endpoint``) on
    ``tasks`` (default: the spec's), its validation split the default file; lines go to its
    eval.jsonl as phase ``manual`` at ``step`` (default: status.json's). What ``job.evaluate``
    does here, and what ``workbench eval --run-dir`` runs on a remote run's target."""
    from workbench.evaluate.sources import open_endpoint
    from workbench.runs.rundir import RunDir

    rd = RunDir(path)
    if not rd.spec_file.is_file():
        raise EvalError(f"{rd.path} is not a run directory (no {rd.spec_file.name}); give the "
                        "folder a run was launched into")
    spec = rd.spec()
    parsed = as_tasks(tasks if tasks is not None else spec.eval.tasks, **knobs)
    validation = rd.data_dir / "validation.jsonl"
    _reach_judges(parsed)
    if endpoint is not None:
        source: Any = open_endpoint(endpoint)
    else:
        art = rd.artefact_dir()
        if art is None:
            raise EvalError(f"run {rd.path.name} has no adapter/ or model/ (state "
                            f"{rd.status().get('state')}); only a run that saved its weights "
                            "can be scored")
        source = _open_weights(art, label="run")
    if step is None:
        step = int(rd.status().get("step") or 0)
    return score(source, parsed, phase="manual", step=step, run_dir=rd.path,
                 default_file=validation if validation.is_file() else None,
                 base_id=spec.model.id)
