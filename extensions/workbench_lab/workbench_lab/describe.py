"""What tells a run apart in the panel: on its card, the settings that differ from runs of the
same name and its newest score; in its details, its scores beside the base model's, the knobs a
reader compares runs by and the whole spec. Read from the library (spec, eval.jsonl), nothing
computed twice.
"""

from __future__ import annotations

from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs.jobs import Job


def distinguish(rows: list[dict[str, Any]], jobs: list[Job]) -> None:
    """What tells a card from the others: ``differs``, the spec settings that differ between
    runs of the same name (``lr 0.003``; ``id ...`` when none does), and ``score``, the run's
    newest evaluation score (the first task's first metric, as eval.jsonl records it)."""
    from workbench.evaluate import results
    from workbench.widgets.compare import spec_diff

    by_name: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_name.setdefault(row["name"], []).append(i)
    for name, index in by_name.items():
        diff: dict[str, list[Any]] = {}
        if len(index) > 1:
            try:
                diff = spec_diff([jobs[i] for i in index])
            except (OSError, ValueError, WorkbenchError):
                diff = {}
        for at, i in enumerate(index):
            parts = [f"{key.rsplit('.', 1)[-1]} {_short(values[at])}"
                     for key, values in diff.items() if key != "name"][:3]
            if len(index) > 1 and not parts:
                parts = [f"id {rows[i]['id'][len(name) + 1:]}"]  # the id's date and suffix
            rows[i]["differs"] = " · ".join(parts) or None
            try:
                scores = results.flat([ln for ln in results.read(jobs[i].run_dir.path)
                                       if ln.get("model") != "base"])
            except (OSError, ValueError):
                scores = {}
            first = next(iter(scores.items()), None)
            rows[i]["score"] = (f"{first[0].replace('.', ' ')} {_short(first[1])}"
                                if first else None)


def scores(job: Job) -> list[dict[str, Any]]:
    """The newest score of each task and metric the run was evaluated on, beside the base model's
    where it was scored too (eval.jsonl, the one record of evaluations)."""
    from workbench.evaluate import results

    try:
        lines = results.read(job.run_dir.path)
    except (OSError, ValueError):
        return []
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for line in lines:  # oldest first: a later line replaces an earlier one
        newest[(line.get("task", "?"), str(line.get("model", "run")))] = line
    out = []
    for (task, model), line in newest.items():
        if model != "run":
            continue
        base = newest.get((task, "base"), {}).get("metrics", {})
        for metric, value in line.get("metrics", {}).items():
            out.append({"task": task, "metric": metric, "value": value,
                        "base": base.get(metric), "n": line.get("n"), "step": line.get("step")})
    return out


def settings(job: Job) -> dict[str, Any]:
    """The knobs a reader compares runs by, as ``[label, value]`` rows, and the whole spec as
    YAML (``spec_yaml``) behind them."""
    try:
        spec = job.spec
    except (OSError, ValueError, WorkbenchError):
        return {"settings": [], "spec_yaml": ""}
    m, t, d, r = spec.method, spec.train, spec.data, spec.resources
    method = f"{m.kind} · {m.stage}"
    if m.kind in ("lora", "qlora"):
        method += f" · r {m.lora_r}, alpha {m.lora_alpha}"
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs:g} epoch(s)"
    hardware = (f"{r.nodes} x {r.gpus_per_node} {r.gpu_type or 'GPU'}" if r.gpus_per_node
                else f"{r.nodes} node(s), CPU")
    rows = [["model", spec.model.id], ["method", method], ["learning rate", f"{t.lr:g}"],
            ["length", length], ["batch", f"{t.batch_size} x {t.grad_accum} accumulation"],
            ["max length", f"{d.max_length} tokens" + (", packed" if d.packing else "")],
            ["data", ", ".join(s.path for s in d.sources)],
            ["target", f"{spec.target} ({hardware})"]]
    return {"settings": rows, "spec_yaml": spec.to_yaml()}


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def downsample(values: list[Any], n: int) -> list[Any]:
    """At most ``n`` evenly spaced items, always keeping the last one (the newest point)."""
    if len(values) <= n:
        return list(values)
    stride = (len(values) - 1) / (n - 1)
    return [values[round(i * stride)] for i in range(n)]


def comparison(jobs: list[Job], points: int = 200) -> dict[str, Any]:
    """Runs side by side, as the panel's Compare view shows them: the settings that differ
    first, then the losses and scores (``better``: which way is better), and each run's loss
    curve. The table is :func:`workbench.widgets.compare.compare_df`'s, reordered."""
    from workbench.widgets.compare import BASE, EVAL, SPEC, compare_df

    df = compare_df(jobs)
    columns: list[dict[str, Any]] = []
    for c in df.columns:
        if c.startswith(SPEC) and c != SPEC + "name":
            columns.append({"key": c, "label": c.removeprefix(SPEC), "kind": "setting"})
    for c in df.columns:
        if not c.startswith((SPEC, EVAL, BASE)) and c not in ("name", "state", "best step"):
            columns.append({"key": c, "label": c, "kind": "result",
                            "better": "lower" if "loss" in c else None})
    for prefix, kind in ((EVAL, "score"), (BASE, "base")):
        for c in df.columns:
            if c.startswith(prefix):
                lower = "loss" in c or "perplexity" in c
                columns.append({"key": c, "label": c.removeprefix(prefix).replace(".", " "),
                                "kind": kind, "better": "lower" if lower else "higher"})
    rows = []
    for job in jobs:
        record = df.loc[job.id]
        rows.append({"id": job.id, "name": job.name, "state": record.get("state"),
                     "values": [_cell(record.get(c["key"])) for c in columns]})
    curves = {job.id: downsample([[m["step"], m["loss"]] for m in job.metrics()
                                  if "step" in m and "loss" in m and "event" not in m], points)
              for job in jobs}
    return {"columns": columns, "rows": rows, "curves": curves}


def _cell(value: Any) -> Any:
    """A table cell as JSON: numbers stay numbers (NaN: none), anything else reads as text."""
    import math

    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
