"""Take a run's model home: :func:`export` writes merged weights, GGUF files and an Ollama Modelfile,
each with a model card, and checks each by loading it in the tool it is for.

    >>> report = job.export(["merged", "gguf", "ollama"], quant=["f16", "q4_k_m"])  # doctest: +SKIP

Layout (default ``RUN_DIR/export``): ``merged/`` (Hugging Face layout, safetensors, tokenizer and
chat template, README.md, export.json) and ``gguf/`` (``model-<type>.gguf`` per type, README.md,
export.json, and the ``Modelfile`` for format ``ollama``). Everything is written under a temporary
folder beside them and moved into place only once every file is written and checked, so a failure
leaves the previous export (or none), never a half-written one. What cannot work is refused before
any work: an unknown format or type, missing llama.cpp tools, an architecture the converter does
not know, too little disk. The checks compare greedy tokens on the run's own validation prompts:
the merged model against base + adapter (both in transformers), each GGUF (in llama.cpp through
llama-cpp-python) against the merged model; their figures go to the cards, export.json and the
run's status.json (``export``). With a wallet the export is held and charged like an evaluation.
Before any work the export makes its plan (:mod:`workbench.serve.export_plan`: disk, memory,
time; ``plan_only=True`` returns it), prints it first and refuses on disk with its figures; a run
whose weights are on its SSH host or Slurm cluster is exported there
(:mod:`workbench.serve.export_remote`) and its folders come back.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import workbench.serve.gguf as g
from workbench.errors import ExportError
from workbench.serve.export_plan import ExportPlan, plan_for, size_text
from workbench.serve.export_source import (  # noqa: F401  (FORMATS, DTYPES re-exported)
    DTYPES,
    FORMATS,
    RunSource,
    base_dir,
    resolve_run,
    validate,
)

# The disk check asks this much more than the plan's estimate (sizes are within ~10% of it).
DISK_MARGIN = 1.15
# A float export (merged weights, an f16/bf16/f32 GGUF) whose greedy tokens agree less than this
# with the model it came from is refused; quantised files have their agreement reported only.
MIN_AGREEMENT = 0.9


@dataclass
class ExportReport:
    """What :func:`export` wrote and what its checks measured."""

    run_id: str
    folders: dict[str, Path] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def __repr__(self) -> str:
        rows = [f"export of {self.run_id} in {self.seconds:.1f} s"]
        rows += [f"  {k}: {v}" for k, v in self.folders.items()]
        rows += [f"  check {c['file']} ({c['tool']} vs {c['against']}): {c['identical']}/"
                 f"{c['prompts']} prompts identical, {c['token_agreement']:.1%} tokens" for c in
                 self.checks]
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "folders": {k: str(v) for k, v in self.folders.items()},
                "checks": self.checks, "seconds": round(self.seconds, 2)}


def _say(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    start = time.time()

    def say(msg: str) -> None:
        if progress:
            print(f"[export {time.time() - start:6.1f}s] {msg}", flush=True)
    return say


def agreement(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Identical sequences, and the share of tokens that agree before the first difference."""
    same = total = identical = 0
    for a, b in zip(ref, got, strict=True):
        prefix = 0
        while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
            prefix += 1
        n = max(len(a), len(b), 1)  # two empty answers (EOS first) agree: one token each
        same += n if list(a) == list(b) else prefix
        total += n
        identical += list(a) == list(b)
    return {"prompts": len(ref), "identical": identical,
            "token_agreement": same / total if total else 1.0}


def run_prompts(run_dir: Path, limit: int = 8) -> list[str]:
    """The run's own prompts: the first user messages of its validation split (else train)."""
    for split in ("validation", "train"):
        path = run_dir / "data" / f"{split}.jsonl"
        if not path.is_file():
            continue
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            user = [m["content"] for m in row.get("messages", []) if m.get("role") == "user"]
            if user:
                out.append(str(user[0]))
            if len(out) >= limit:
                return out
        if out:
            return out
    return ["Hello!"]


def _greedy(model: Any, ids: list[list[int]], max_new: int, eos: int | None) -> list[list[int]]:
    import torch

    out = []
    for prompt in ids:  # one at a time: no padding, so nothing differs from a plain prompt
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=eos)
        new = gen[0, len(prompt):].tolist()
        out.append(new[:new.index(eos)] if eos in new else new)
    return out


def _files(folder: Path) -> list[dict[str, Any]]:
    return [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".")]


@overload
def export(run: Any, formats: Sequence[str] | str = ..., *, quant: Sequence[str] | str = ...,
           out: str | Path | None = ..., dtype: str = ..., verify: bool = ...,
           max_new_tokens: int = ..., prompts: Sequence[str] | None = ...,
           progress: bool | Callable[[str], None] = ...,
           plan_only: Literal[False] = ...) -> ExportReport: ...


@overload
def export(run: Any, formats: Sequence[str] | str = ..., *, quant: Sequence[str] | str = ...,
           out: str | Path | None = ..., dtype: str = ..., verify: bool = ...,
           max_new_tokens: int = ..., prompts: Sequence[str] | None = ...,
           progress: bool | Callable[[str], None] = ...,
           plan_only: Literal[True]) -> ExportPlan: ...


def export(run: Any, formats: Sequence[str] | str = ("merged",), *,
           quant: Sequence[str] | str = ("f16",), out: str | Path | None = None,
           dtype: str = "float32", verify: bool = True, max_new_tokens: int = 16,
           prompts: Sequence[str] | None = None,
           progress: bool | Callable[[str], None] = True,
           plan_only: bool = False) -> ExportReport | ExportPlan:
    """Export ``run`` (a Job, run id or name) to ``formats`` (merged, gguf, ollama) under ``out``
    (default RUN_DIR/export); ``quant``: the GGUF types (f16, bf16, f32, q8_0, q4_k_m, ...).
    A run whose weights are on its SSH host or Slurm cluster is exported there and the folders
    come back into ``out``. ``plan_only``: return the :class:`ExportPlan` (disk, memory, time)
    and do nothing."""
    fmts, types = validate(formats, quant, dtype)
    src = resolve_run(run)
    n_prompts = len(prompts) if prompts else 8
    plan = plan_for(src, fmts, types, dtype, verify, max_new_tokens, n_prompts)
    if plan_only:
        return plan
    root = Path(out) if out is not None else src.run_dir / "export"
    say = _say(progress)
    if src.remote is None:
        _refuse_before_work(src, fmts, types, root, plan)
    else:  # the folders come back here: the disk for them is checked here, the rest there
        _check_disk(root, plan, only_kept=True)
    say(f"export of {src.run_id} on {plan.where}: {plan.headline()}")
    from workbench.runs.rundir import RunDir
    from workbench.runs.wallet import Wallet

    rd = RunDir(src.run_dir)
    wallet = Wallet.open()
    held, limit = None, None
    if wallet is not None:
        minutes = float(wallet.settings["eval_hold_minutes"])
        held = wallet.hold_time(rd.spec(), minutes, f"export of {src.run_id}", "export",
                                src.run_id, str(src.run_dir))
        limit = minutes * 60 if held is not None else None
    started = time.time()
    try:
        if src.remote is not None:
            from workbench.serve.export_remote import export_on_target

            request = {"formats": fmts, "quant": types, "dtype": dtype, "verify": verify,
                       "max_new_tokens": max_new_tokens, "prompts": list(prompts or [])}
            report = ExportReport(src.run_id)
            answer = export_on_target(src, request, root, say, limit)
            report.folders = {k: Path(v) for k, v in answer["folders"].items()}
            report.checks, report.seconds = answer["checks"], time.time() - started
            rd.write_status(export={**report.to_dict(), "where": plan.where, "time": time.time()})
            return report
        return export_here(src, fmts, types, root, dtype=dtype, verify=verify,
                           max_new_tokens=max_new_tokens, prompts=prompts, say=say, limit=limit)
    finally:
        if held is not None:
            wallet.charge_time(*held, time.time() - started,  # type: ignore[union-attr]
                               f"export {src.run_id}")


def _refuse_before_work(src: RunSource, fmts: list[str], types: list[str], root: Path,
                        plan: ExportPlan) -> None:
    """What cannot work, refused before anything is written: GGUF without llama.cpp's tools or
    for an architecture its converter does not know, and too little disk."""
    if {"gguf", "ollama"} & set(fmts):
        g.require_tools()
        base = base_dir(src.art)
        g.check_convertible(base if (base / "config.json").is_file() else src.art)
    _check_disk(root, plan)


def _check_disk(root: Path, plan: ExportPlan, only_kept: bool = False) -> None:
    """Refuse when ``root``'s disk has less free than the plan says the export writes (with
    DISK_MARGIN for the estimate), or only what is kept when the work is done elsewhere."""
    root.mkdir(parents=True, exist_ok=True)
    need = (sum(plan.files.values()) if only_kept else plan.disk_bytes) * DISK_MARGIN
    free = shutil.disk_usage(root).free
    if need > free:
        raise ExportError(f"the export needs about {size_text(need)} of disk in {root} (its plan"
                          f": {plan.headline()}) but {size_text(free)} is free; pass out= on a "
                          "larger disk")


def export_here(src: RunSource, fmts: list[str], types: list[str], root: Path, *,
                dtype: str = "float32", verify: bool = True, max_new_tokens: int = 16,
                prompts: Sequence[str] | None = None, say: Callable[[str], None] = print,
                limit: float | None = None) -> ExportReport:
    """The export on this machine, checks done: written under a temporary folder in ``root`` and
    moved into place when every file is checked; stopped at ``limit`` seconds (a wallet's hold)."""
    from workbench.runs.deadline import stop_at
    from workbench.runs.rundir import RunDir

    started = time.time()
    tmp = root / f".tmp-{os.getpid()}-{int(started)}"
    try:
        with stop_at(limit, ExportError, f"the export of {src.run_id} was stopped at its wallet "
                     f"hold and charged it; nothing was written to {root}. Allow more with "
                     "workbench.credit(eval_hold_minutes=...)"):
            return _export(src.art, RunDir(src.run_dir), src.run_id, fmts, types, tmp, root,
                           dtype, verify, max_new_tokens,
                           list(prompts) if prompts else run_prompts(src.run_dir), say, started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export(art: Path, rd: Any, run_id: str, fmts: list[str], types: list[str], tmp: Path,
            root: Path, dtype: str, verify: bool, max_new: int, prompts: list[str],
            say: Callable[[str], None], started: float) -> ExportReport:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data.tokenize import ensure_chat_template
    from workbench.serve.sources import merge_adapter

    report = ExportReport(run_id)
    merged = tmp / "merged"
    if (art / "adapter_config.json").is_file():
        say(f"merging the adapter {art} into its base ({dtype})")
        merge_adapter(art, merged)
        (merged / ".merged-from").unlink(missing_ok=True)
    else:
        say(f"copying the full model {art}")
        shutil.copytree(art, merged, ignore=shutil.ignore_patterns("training_args.bin", ".*"))
    tok = AutoTokenizer.from_pretrained(str(merged))
    ensure_chat_template(tok)
    if dtype != "float32":
        import torch

        model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=getattr(torch, dtype))
        for p in merged.glob("*.safetensors"):
            p.unlink()
        model.save_pretrained(merged)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    eos = tok.eos_token_id
    ref: list[list[int]] = []
    if verify:
        say(f"checking the merged model against base + adapter on {len(ids)} prompts")
        from workbench.serve.infer import load_chat_model

        trained = _greedy(load_chat_model(art).model, ids, max_new, eos)
        ref = _greedy(AutoModelForCausalLM.from_pretrained(str(merged)).eval(), ids, max_new, eos)
        _check(report, "merged/", "transformers", "base + adapter (transformers + peft)",
               trained, ref, strict=True, say=say)
    gguf_dir = tmp / "gguf"
    if {"gguf", "ollama"} & set(fmts):
        gguf_dir.mkdir(parents=True)
        floats = [t for t in types if t in g.FLOAT_TYPES]
        source = "f16" if "f16" in floats or not floats else floats[0]
        src_file = gguf_dir / f"model-{source}.gguf"
        say(f"converting to GGUF {source} with llama.cpp's convert_hf_to_gguf.py")
        g.convert(merged, src_file, source, progress=say)
        for t in floats:
            if t != source:
                g.convert(merged, gguf_dir / f"model-{t}.gguf", t, progress=say)
        for t in types:
            if t in g.QUANT_TYPES:
                say(f"quantising to {t} with llama.cpp")
                g.quantize(src_file, gguf_dir / f"model-{t}.gguf", t, progress=say)
        if source not in types:
            src_file.unlink()
        add_bos = None
        for t in types:
            f = gguf_dir / f"model-{t}.gguf"
            say(f"loading {f.name} in llama.cpp")
            got = g.generate(f, ids, max_new, texts=texts[:1])
            add_bos = got["add_bos"]
            if verify:
                _check(report, f"gguf/{f.name}", f"llama.cpp (llama-cpp-python {g.LLAMA_CPP_PYTHON})",
                       "merged model (transformers)", ref, got["tokens"],
                       strict=t in g.FLOAT_TYPES, say=say)
        if "ollama" in fmts:
            _write_modelfile(gguf_dir, tok, types, prompts, bool(add_bos), say)
    say("writing the model cards")
    from workbench.serve.modelcard import model_card

    spec = rd.spec()
    seconds = time.time() - started
    folders = {"merged": merged} if "merged" in fmts else {}
    if gguf_dir.is_dir():
        folders["gguf"] = gguf_dir
    for name, folder in folders.items():
        fmt = "gguf + ollama" if name == "gguf" and "ollama" in fmts else name
        checks = [c for c in report.checks if c["file"].startswith(f"{name}/")]
        record = {"format": fmt, "files": _files(folder), "checks": checks,
                  "seconds": round(seconds, 1), "run_id": run_id, "dtype": dtype}
        (folder / "README.md").write_text(model_card(rd.path, spec, record), encoding="utf-8")
        (folder / "export.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    for name, folder in folders.items():  # every file is written and checked: move into place
        final = root / name
        old = root / f".old-{name}-{os.getpid()}"
        if final.exists():
            final.rename(old)
        folder.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        report.folders[name] = final
    report.seconds = time.time() - started
    rd.write_status(export={**report.to_dict(), "time": time.time()})
    say(f"done in {report.seconds:.1f} s: " + ", ".join(str(p) for p in report.folders.values()))
    return report


def _check(report: ExportReport, file: str, tool: str, against: str, ref: list[list[int]],
           got: list[list[int]], strict: bool, say: Callable[[str], None]) -> None:
    figures = {"file": file, "tool": tool, "against": against, **agreement(ref, got)}
    report.checks.append(figures)
    say(f"{file}: {figures['identical']}/{figures['prompts']} prompts identical, "
        f"{figures['token_agreement']:.1%} of tokens agree")
    if strict and figures["token_agreement"] < MIN_AGREEMENT:
        raise ExportError(f"{file} answers differently from the {against}: only "
                          f"{figures['token_agreement']:.1%} of greedy tokens agree (at least "
                          f"{MIN_AGREEMENT:.0%} needed); nothing was exported")


def _write_modelfile(gguf_dir: Path, tok: Any, types: list[str], prompts: list[str],
                     add_bos: bool, say: Callable[[str], None]) -> None:
    from workbench.serve.export_ollama import chat_parts, modelfile, render_parts

    parts = chat_parts(tok)
    for p in prompts:  # the Modelfile's pieces must render what the Jinja template renders
        for conv in ([{"role": "user", "content": p}],
                     [{"role": "user", "content": p}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": p}]):
            jinja = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            if render_parts(parts, conv, gen=True) != jinja:
                raise ExportError("the Modelfile's template would render the run's prompts "
                                  "differently from its chat template; nothing was exported")
    pick = next((t for t in ("q4_k_m", "q8_0", "f16") if t in types), types[0])
    (gguf_dir / "Modelfile").write_text(modelfile(f"model-{pick}.gguf", parts,
                                                  lead_in_template=not add_bos), encoding="utf-8")
    say(f"Modelfile: FROM model-{pick}.gguf, stop {', '.join(parts.stops)}")
