"""What an export starts from: the formats and GGUF types asked for, checked (:func:`validate`),
and the run they are asked of (:func:`resolve_run`): its artefact folder, run directory, the base
model folder of an adapter (:func:`base_dir`), and where its weights are (this machine, an SSH
host, a Slurm cluster). The plan (export_plan), the export itself (export_run) and the export on
a run's target (export_remote) all start here, so they agree on what "the run" is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workbench.serve.gguf as g
from workbench.errors import ExportError

FORMATS = ("merged", "gguf", "ollama")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RunSource:
    """The run an export reads: ``handle`` (a Job or a registry lookup) has its backend;
    ``remote``: where its weights are when that is not this machine (else None)."""

    art: Path
    run_dir: Path
    run_id: str
    handle: Any = None
    remote: str | None = None


def validate(formats: Sequence[str] | str, quant: Sequence[str] | str,
             dtype: str) -> tuple[list[str], list[str]]:
    """(formats, GGUF types) checked; an unknown one is refused with the list to choose from."""
    fmts = [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise ExportError(f"unknown export format {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    types = g.check_quant([quant] if isinstance(quant, str) else list(quant))
    if {"gguf", "ollama"} & set(fmts) and not types:
        raise ExportError("a GGUF export needs at least one type in quant= (e.g. f16)")
    return fmts, types


def resolve_run(run: Any) -> RunSource:
    """The artefact folder, run directory and id of a Job, run id or name, or RUN_DIR/adapter."""
    from workbench.serve.sources import _Run, _source_to_path, require_adapter_weights

    where, _, run_id = _source_to_path(run)
    if not isinstance(where, str) and (where / "spec.yaml").is_file():  # a RUN_DIR given
        from workbench.runs.rundir import RunDir

        where = RunDir(where).artefact_dir() or where / "adapter"
    if isinstance(where, str) or not (where.parent / "spec.yaml").is_file():
        raise ExportError(f"{where} is not a run's adapter/ or model/ folder; export takes a run "
                          "(Job, id or name)")
    if (where / "adapter_config.json").is_file():
        require_adapter_weights(where)
    handle = run if hasattr(run, "backend") else None
    if handle is None and run_id:
        handle = _Run(run_id)
    return RunSource(where, where.parent, run_id or where.parent.name, handle,
                     _remote_place(where.parent, handle))


def _remote_place(run_dir: Path, handle: Any) -> str | None:
    """Where a run's weights are when not here: its first SSH host, or its Slurm cluster (a run
    kept in place on this login node is exported on a compute node too)."""
    from workbench.evaluate.remote import placed_elsewhere
    from workbench.targets.backends.remote import load_placement
    from workbench.targets.backends.slurm import SlurmBackend

    backend = getattr(handle, "backend", None)
    if isinstance(backend, SlurmBackend):
        return f"a compute node of slurm:{backend.target.name}"
    if placed_elsewhere(run_dir):
        nodes = load_placement(run_dir).get("nodes") or [{}]
        return f"host {nodes[0].get('host') or '(the first of the run)'}"
    return None


def base_dir(art: Path) -> Path:
    """The model folder an adapter was trained on (``art`` itself for a full model)."""
    if not (art / "adapter_config.json").is_file():
        return art
    from workbench.spec.models import resolve_model

    meta = json.loads((art / "workbench.json").read_text()) if (
        art / "workbench.json").is_file() else {}
    cfg = json.loads((art / "adapter_config.json").read_text())
    return Path(resolve_model(str(meta.get("base_model") or cfg["base_model_name_or_path"])))
