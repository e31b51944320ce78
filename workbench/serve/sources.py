"""What to serve: the runs, adapters and model folders given to ``deploy``, as one serving plan.

:func:`plan_serving` turns sources (a Job, a run id or name, an adapter or model folder, a base
model id) into a :class:`ServePlan`: the model vLLM loads, the LoRA adapters on top of it, the
names they are served under and the chat template the run trained with; it refuses sources that
cannot share one server. :func:`merge` folds a run's adapter into its base weights instead.
Nothing here knows where the server runs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import AdapterNotFoundError, DeployError, RunNotFoundError


@dataclass
class Adapter:
    """One LoRA adapter to serve under ``name`` on top of ``base``."""

    name: str
    path: Path
    base: str  # the base model folder (or hub id) the adapter was trained on
    rank: int
    run_id: str | None = None


@dataclass
class ServePlan:
    """What one server will serve: a model (base or merged/full weights) plus adapters."""

    model: str  # folder or hub id given to --model
    model_name: str  # --served-model-name
    adapters: list[Adapter] = field(default_factory=list)
    chat_template: str | None = None  # the template the run trained with
    run_ids: list[str] = field(default_factory=list)
    merged: bool = False
    revision: str | None = None  # the base model's revision the runs trained on (hub ids)
    trust_remote_code: bool = False
    gpus: int = 0  # the most GPUs per node any run served trained with (a Slurm job asks for one)
    notes: list[str] = field(default_factory=list)  # what differs from training, said at deploy

    @property
    def names(self) -> list[str]:
        return [self.model_name] + [a.name for a in self.adapters]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _source_to_path(source: Any) -> tuple[Path | str, str | None, str | None]:
    """(folder or model id, run name, run id) of one thing to serve."""
    if hasattr(source, "run_dir") and hasattr(source, "id"):  # a Job
        art = source.run_dir.artefact_dir()
        if art is None:
            raise AdapterNotFoundError(
                f"run {source.id} has no adapter/ or model/ folder (state {source.state}); wait "
                "for it to succeed (job.wait()) before deploying it"
            )
        return art, source.name, source.id
    text = str(source)
    path = Path(os.path.expanduser(text))
    if not path.exists() and _looks_like_hub_id(text):
        return text, None, None
    if path.exists() or "/" in text or text.startswith((".", "~")):
        if not path.is_dir():
            raise AdapterNotFoundError(
                f"adapter/model folder {path} does not exist; pass a run (Job, id or name), its "
                "RUN_DIR/adapter folder, or a model folder saved with save_pretrained"
            )
        return path, None, None
    if text.startswith("builtin:"):
        return text, None, None
    try:
        return _source_to_path(_Run(text))
    except RunNotFoundError:
        raise AdapterNotFoundError(
            f"{text!r} is neither a run (id or name), an existing folder, nor a built-in model; "
            "`workbench status` lists the runs"
        ) from None


class _Run:
    """A run found by id or name: as much of a ``Job`` as serving reads.

    ``workbench.runs.jobs`` imports this package (``Job.deploy``), so this side reads the registry,
    the run directory and the backend itself rather than importing ``workbench.runs.jobs`` back.
    """

    def __init__(self, id_or_name: str) -> None:
        from workbench.runs.registry import Registry
        from workbench.runs.rundir import RunDir
        from workbench.targets.backends import get_backend

        self.record = Registry().get_run(id_or_name)
        self.backend = get_backend(self.record.target)
        self.run_dir = RunDir(self.record.run_dir)
        self.id, self.name = self.record.id, self.record.name

    @property
    def state(self) -> str:  # as Job.state: what the backend sees now, not the registry's copy
        from workbench.runs.rundir import PENDING

        status = self.backend.status(self.run_dir.path, self.record.backend_job_id)
        return str(status.get("state", PENDING))


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft saves and loads


def require_adapter_weights(folder: Path) -> None:
    """Refuse an adapter folder that has its config but no weights (a copy cut short, a save
    that died): vLLM and peft would otherwise fail later with an error that names neither."""
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise AdapterNotFoundError(
            f"{folder} has adapter_config.json but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})"
            "; the save or copy did not finish: copy the folder again, or resume the run "
            "(job.resume()) so it saves its adapter"
        )


def _looks_like_hub_id(text: str) -> bool:
    """ORG/NAME (a base model on the hub), not a mistyped RUN_DIR/adapter path."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None
            and text.rsplit("/", 1)[1] not in ("adapter", "model", "merged"))


def _default_name(path: Path, run_name: str | None) -> str:
    if run_name:
        return run_name
    # RUN_DIR/adapter or RUN_DIR/model: the run directory names it better than "adapter".
    return path.parent.name if path.name in ("adapter", "model", "merged") else path.name


def _resolve_base(model: str) -> str:
    from workbench.spec.models import resolve_model

    return resolve_model(model)


def _chat_template_of(folder: str) -> str | None:
    """The chat template generation must use: the run's own, as training and infer.py render it.

    Read from the files save_pretrained writes, not through AutoTokenizer: importing
    transformers would add seconds to every deploy.
    """
    path = Path(folder)
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, str) and template:
        return template
    from workbench.data.tokenize import FALLBACK_CHAT_TEMPLATE  # what ensure_chat_template sets

    return str(FALLBACK_CHAT_TEMPLATE)


def plan_serving(sources: Sequence[Any], merge: bool = False) -> ServePlan:
    """Work out model, adapters and names for ``sources``; raise if they cannot share a server."""
    if not sources:
        raise DeployError("nothing to deploy; pass a run (Job, id or name) or a model folder")
    adapters: list[Adapter] = []
    models: list[tuple[str, str, str | None]] = []  # (folder/id, name, run id)
    trained = _TrainedWith()
    for source in sources:
        where, run_name, run_id = _source_to_path(source)
        if isinstance(where, str):  # a built-in or hub model id
            models.append((_resolve_base(where), where, None))
            continue
        trained.add(where)
        if (where / "adapter_config.json").is_file():
            require_adapter_weights(where)
            cfg = _read_json(where / "adapter_config.json")
            meta = _read_json(where / "workbench.json")
            base = meta.get("base_model") or cfg.get("base_model_name_or_path")
            if not base:
                raise DeployError(f"adapter {where} does not say which base model it belongs to")
            if not (str(base).startswith("builtin:") or Path(base).is_dir()) and meta.get(
                    "base_model_id"):
                base = meta["base_model_id"]  # the folder moved (another machine): the id still works
            adapters.append(Adapter(_default_name(where, run_name), where, _resolve_base(str(base)),
                                    int(cfg.get("r", 8)), run_id))
        elif (where / "config.json").is_file():
            models.append((str(where.resolve()), _default_name(where, run_name), run_id))
        else:
            raise AdapterNotFoundError(
                f"{where} holds neither a peft adapter (adapter_config.json) nor a model "
                "(config.json); pass a run's adapter/ or model/ folder"
            )
    if merge:
        if len(adapters) != 1 or models:
            raise DeployError("merge=True serves exactly one adapter's merged weights; pass one run")
        a = adapters[0]
        return trained.apply(ServePlan(str(merge_adapter(a.path)), a.name, [],
                                       _chat_template_of(str(a.path)),
                                       [a.run_id] if a.run_id else [], merged=True))
    bases = {a.base for a in adapters} | {m[0] for m in models}
    if len(bases) > 1:
        raise DeployError(
            "one server serves one model: these need different bases "
            f"({', '.join(sorted(bases))}); deploy them separately"
        )
    names = [a.name for a in adapters]
    dupes = {n for n in names if names.count(n) > 1}
    for a in adapters:  # two runs of the same name: fall back to their unique ids
        if a.name in dupes:
            a.name = a.run_id or a.path.parent.name
    if models:
        model, model_name, run_id = models[0]
    else:
        model = adapters[0].base
        model_name = _base_name(model)
        run_id = None
    template_from = str(adapters[0].path) if adapters else model
    run_ids = [a.run_id for a in adapters if a.run_id] + ([run_id] if run_id else [])
    return trained.apply(ServePlan(model, model_name, adapters, _chat_template_of(template_from),
                                   run_ids))


class _TrainedWith:
    """What the runs served were trained with (from RUN_DIR/spec.yaml beside their adapter or
    model folder) that the server must match: the base's revision and remote code, the GPUs,
    and QLoRA's 4-bit base, which vLLM serves unquantised."""

    def __init__(self) -> None:
        self.specs: list[tuple[Path, Any]] = []

    def add(self, folder: Path) -> None:
        spec_file = folder.parent / "spec.yaml"
        if folder.name not in ("adapter", "model", "merged") or not spec_file.is_file():
            return  # a folder from elsewhere: nothing known about its training
        from workbench.spec import RunSpec

        try:
            self.specs.append((folder, RunSpec.from_yaml(spec_file)))
        except Exception:  # noqa: BLE001 - an unreadable spec must not stop serving its weights
            return

    def apply(self, plan: ServePlan) -> ServePlan:
        revisions = {s.model.revision for _, s in self.specs if s.model.revision}
        if len(revisions) > 1:
            raise DeployError(f"these runs trained on different revisions of the base model "
                              f"({', '.join(sorted(revisions))}); deploy them separately")
        plan.revision = next(iter(revisions), None)
        plan.trust_remote_code = any(s.model.trust_remote_code for _, s in self.specs)
        plan.gpus = max((s.resources.gpus_per_node for _, s in self.specs), default=0)
        for folder, s in self.specs:
            if s.method.kind == "qlora":
                plan.notes.append(
                    f"{folder.parent.name} trained QLoRA on a 4-bit base; the server loads the "
                    "base unquantised (its answers can differ slightly from training's)")
        return plan


def _base_name(model: str) -> str:
    from workbench.assets.tiny_model import builtin_model_path

    try:
        if Path(model).resolve() == builtin_model_path().resolve():
            return "tiny-llama"
    except OSError:
        pass
    return Path(model).name if Path(model).is_dir() else model


# -- merged weights --------------------------------------------------------------------------------
def merge(source: Any, out: str | Path | None = None) -> Path:
    """Fold a run's LoRA adapter into its base weights; return the folder (default RUN_DIR/merged).

    The result is a plain model folder (weights, config, tokenizer with the run's chat template)
    that vLLM or transformers load like any other. A merge already done is reused.
    """
    where, _, _ = _source_to_path(source)
    if isinstance(where, str) or not (where / "adapter_config.json").is_file():
        raise AdapterNotFoundError(f"{where} is not a LoRA adapter folder; nothing to merge")
    require_adapter_weights(where)
    return merge_adapter(where, out)


def merge_adapter(adapter: Path, out: str | Path | None = None) -> Path:
    out = Path(out) if out is not None else adapter.parent / "merged"
    weights = adapter / "adapter_model.safetensors"
    stamp = out / ".merged-from"
    if stamp.is_file() and weights.is_file() and stamp.stat().st_mtime >= weights.stat().st_mtime:
        return out
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data.tokenize import ensure_chat_template

    meta = _read_json(adapter / "workbench.json")
    cfg = _read_json(adapter / "adapter_config.json")
    base = _resolve_base(str(meta.get("base_model") or cfg["base_model_name_or_path"]))
    # float32 keeps the merged weights bit-comparable with base + adapter applied at run time.
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tok = AutoTokenizer.from_pretrained(str(adapter))
    ensure_chat_template(tok)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".merged-from").write_text(str(adapter.resolve()) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
