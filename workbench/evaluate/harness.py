"""The ``lm_eval`` task: lm-evaluation-harness tasks by name or by task YAML file (offline works).

A task YAML that points at local data (``dataset_path: json`` with
``dataset_kwargs: {data_files: {test: /abs/file.jsonl}}``) runs with no hub. The YAML is checked
before lm-eval sees it, so a missing field is one clear :class:`EvalTaskError` rather than a
traceback from deep inside the harness. Indexing lm-eval's built-in tasks takes ~14 s, so it is
done only when a task is named (not for YAML files alone) and once per process.

Weights in this process are wrapped as ``HFLM(pretrained=model)`` (no second load); an endpoint
goes through lm-eval's ``local-completions`` model.
"""

from __future__ import annotations

import difflib
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import yaml

from workbench.errors import EvalTaskError

_MANAGERS: dict[tuple[bool, tuple[str, ...]], Any] = {}  # indexing is slow: once per process
_NEEDED = ("task", "dataset_path", "doc_to_text")


def check_task_file(path: Path) -> str:
    """The task name a YAML file defines, after checking the fields lm-eval needs."""
    if not path.is_file():
        raise EvalTaskError(f"lm_eval task file {path} does not exist; fix the path in "
                            "eval.tasks[].tasks")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise EvalTaskError(f"lm_eval task file {path} is not valid YAML: {exc}") from None
    if not isinstance(cfg, dict):
        raise EvalTaskError(f"lm_eval task file {path} must be a mapping of task fields")
    if "include" in cfg:
        return str(cfg.get("task") or path.stem)  # the included file holds the rest: lm-eval's job
    missing = [f for f in _NEEDED if f not in cfg]
    mc = cfg.get("output_type") in ("multiple_choice", "loglikelihood")
    if "doc_to_target" not in cfg:
        missing.append("doc_to_target")
    if cfg.get("output_type") == "multiple_choice" and "doc_to_choice" not in cfg:
        missing.append("doc_to_choice")
    if not any(k in cfg for k in ("test_split", "validation_split")):
        missing.append("test_split (or validation_split)")
    if missing:
        kind = "multiple_choice" if mc else "generate_until"
        raise EvalTaskError(
            f"lm_eval task file {path} has no {', '.join(missing)}; a {kind} task needs "
            f"{', '.join(_NEEDED)}, doc_to_target{', doc_to_choice' if mc else ''} and test_split "
            "(see https://github.com/EleutherAI/lm-evaluation-harness/blob/main/docs/"
            "new_task_guide.md)")
    for split, file in ((cfg.get("dataset_kwargs") or {}).get("data_files") or {}).items():
        for f in file if isinstance(file, list) else [file]:
            if not Path(f).is_absolute() or not Path(f).is_file():
                raise EvalTaskError(f"lm_eval task file {path}: data_files.{split} {f} is not an "
                                    "existing absolute path; give the data file's full path")
    return str(cfg["task"])


def resolve(names_or_files: list[str]) -> tuple[list[str], Any]:
    """(task names, TaskManager) for a mix of built-in names and YAML paths; unknown names fail."""
    from lm_eval.tasks import TaskManager

    files = [Path(t).expanduser() for t in names_or_files if t.endswith((".yaml", ".yml"))]
    names = [check_task_file(f) for f in files]
    named = [t for t in names_or_files if not t.endswith((".yaml", ".yml"))]
    include = tuple(sorted({str(f.resolve().parent) for f in files}))
    key = (bool(named), include)
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=list(include) or None,
                                     include_defaults=bool(named))
    tm = _MANAGERS[key]
    for name in named:
        if name not in tm.all_tasks:
            close = difflib.get_close_matches(name, tm.all_tasks, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise EvalTaskError(f"lm_eval has no task {name!r}; {hint}list them with "
                                "`lm-eval ls tasks`, or give a task YAML file's path")
    return names + named, tm


def _model(source: Any, batch_size: int) -> Any:
    if source.kind == "transformers":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=source.model, tokenizer=source.tokenizer, batch_size=batch_size)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url=f"{source.base_url}/completions", model=source.model,
                               tokenizer_backend=None, tokenized_requests=False)


def run(source: Any, tasks: list[str], max_samples: int | None, chat_template: bool = True,
        batch_size: int = 8) -> list[tuple[str, dict[str, float], int, list[dict[str, Any]]]]:
    """One (``lm_eval:TASK``, metrics, n, sample rows) per task lm-eval scored."""
    from lm_eval import simple_evaluate

    names, tm = resolve(tasks)
    lm = _model(source, batch_size)
    use_chat = chat_template and source.kind == "transformers" and bool(
        getattr(source.tokenizer, "chat_template", None))
    with source.inference() if source.kind == "transformers" else nullcontext():
        out = simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=max_samples,
                              log_samples=True, apply_chat_template=use_chat,
                              bootstrap_iters=0)
    if out is None:
        return []  # only the main process of a distributed lm-eval gets results
    results = []
    for task, values in out["results"].items():
        metrics: dict[str, float] = {}
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not filt:
                continue  # "alias", "N/A" standard errors
            metrics[name if filt == "none" else f"{name}_{filt}"] = float(value)
        samples = out.get("samples", {}).get(task, [])
        rows = [{"doc": s.get("doc"), "target": s.get("target"),
                 "response": _first(s.get("filtered_resps")),
                 **{k: s[k] for k in metrics if isinstance(s.get(k), (int, float))}}
                for s in samples]
        n = int(out.get("n-samples", {}).get(task, {}).get("effective", len(samples)))
        results.append((f"lm_eval:{task}", metrics, n, rows))
    return results


def _first(resps: Any) -> Any:
    while isinstance(resps, list) and resps:
        resps = resps[0]
    return resps if isinstance(resps, (str, int, float)) else str(resps)
