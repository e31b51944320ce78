"""The model card (README.md) written into each export: what the model is and how it was made.

:func:`model_card` reads the run directory (spec.yaml, status.json, data/summary.json and
data/stats.json, eval.jsonl, reproduce.zip) and the export's own record (files, checks and their
figures) and writes Markdown with a YAML header that the Hugging Face hub reads. Anything the run
did not record is left out rather than guessed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def _json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def bundle_id(run_dir: Path) -> str | None:
    """The reproduce bundle's id: its run id and the first 12 hex digits of its sha256."""
    zf = run_dir / "reproduce.zip"
    if not zf.is_file():
        return None
    digest = hashlib.sha256(zf.read_bytes()).hexdigest()[:12]
    return f"{run_dir.name}@sha256:{digest}"


def _evals(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = (run_dir / "eval.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a partly written last line
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def model_card(run_dir: Path, spec: Any, export: dict[str, Any]) -> str:
    """README.md text for one export folder of the run at ``run_dir``."""
    status = _json(run_dir / "status.json")
    summary = _json(run_dir / "data" / "summary.json")
    stats = _json(run_dir / "data" / "stats.json")
    base = spec.model.id
    m = spec.method
    t = spec.train
    lines = ["---", f"base_model: {base}" if "/" in base and ":" not in base else
             f"# base model: {base}", "library_name: transformers",
             "tags: [workbench, " + m.kind + ", " + m.stage + "]", "---", "",
             f"# {spec.name or run_dir.name} ({export['format']})", "",
             f"Fine-tuned from `{base}` with Workbench run `{run_dir.name}`; this folder is its "
             f"{export['format']} export.", ""]
    lines += ["## Files", ""]
    for f in export.get("files", []):
        lines.append(f"- `{f['name']}` ({f['bytes'] / 1e6:.2f} MB)")
    if export["format"] == "ollama":
        lines += ["", "Use with Ollama: `ollama create NAME -f Modelfile` in this folder, then "
                  "`ollama run NAME`."]
    elif export["format"] == "gguf":
        lines += ["", "Use with llama.cpp: `llama-cli -m FILE.gguf`, or "
                  "`llama_cpp.Llama(model_path=...)` from Python."]
    else:
        lines += ["", "Use with transformers: `AutoModelForCausalLM.from_pretrained(\".\")` and "
                  "`AutoTokenizer.from_pretrained(\".\")` (the chat template is included)."]
    lines += ["", "## Method", "",
              f"- method: {m.kind} ({m.stage})"
              + (f", LoRA r={m.lora_r}, alpha={m.lora_alpha}, dropout={m.lora_dropout}, "
                 f"targets={m.target_modules}; the adapter is merged into the base weights"
                 if m.kind in ("lora", "qlora") else ""),
              f"- training: epochs={t.epochs}, max_steps={t.max_steps}, batch={t.batch_size} x "
              f"accum {t.grad_accum}, lr={t.lr} ({t.scheduler}, warmup {t.warmup_ratio}), "
              f"weight decay {t.weight_decay}, seed {t.seed}",
              f"- steps run: {status.get('step')} of {status.get('total_steps')}, "
              f"world size {status.get('world_size')}, final train loss "
              f"{_fmt((status.get('summary') or {}).get('train_loss'))}"]
    lines += ["", "## Data", ""]
    for src in summary.get("per_source", []):
        lines.append(f"- `{src.get('path')}`: {src.get('rows')} rows")
    counts = summary.get("counts") or {}
    if counts:
        lines.append("- splits: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    train_stats = (stats.get("splits") or {}).get("train") or {}
    if train_stats:
        tok = train_stats.get("tokens") or {}
        lines.append(f"- train tokens per example: median {tok.get('median')}, p95 "
                     f"{tok.get('p95')}, max {tok.get('max')}; max length "
                     f"{stats.get('max_length')}, truncated {train_stats.get('truncated')}, "
                     f"dropped {train_stats.get('dropped')}")
    cleaning = summary.get("cleaning")
    lines.append(f"- cleaning: {json.dumps(cleaning) if cleaning else 'none'}")
    evals = _evals(run_dir)
    if evals:
        lines += ["", "## Evaluation", "", "| phase | step | task | n | scores |",
                  "|---|---|---|---|---|"]
        for e in evals:
            scores = ", ".join(f"{k} {_fmt(v)}" for k, v in (e.get("metrics") or {}).items())
            lines.append(f"| {e.get('phase')} | {e.get('step')} | {e.get('task')} | "
                         f"{e.get('n')} | {scores} |")
    lines += ["", "## Cost and time", "",
              f"- training: {_fmt(status.get('billed_s'))} s billed, cost "
              f"{_fmt(status.get('cost'))} {status.get('currency') or ''}".rstrip(),
              f"- this export: {_fmt(export.get('seconds'))} s"]
    checks = export.get("checks") or []
    if checks:
        lines += ["", "## Checked by running it", "",
                  "Greedy tokens on the run's own validation prompts, compared token by token:", "",
                  "| file | loaded by | against | prompts identical | tokens agreeing |",
                  "|---|---|---|---|---|"]
        for c in checks:
            lines.append(f"| `{c['file']}` | {c['tool']} | {c['against']} | "
                         f"{c['identical']}/{c['prompts']} | {c['token_agreement']:.1%} |")
    lines += ["", "## Reproduce", ""]
    bid = bundle_id(run_dir)
    lines.append(f"- reproduce bundle: `{bid}` (RUN_DIR/reproduce.zip)" if bid else
                 "- no reproduce bundle was written for this run")
    lines.append(f"- exported by Workbench from `{run_dir}`")
    return "\n".join(lines) + "\n"
