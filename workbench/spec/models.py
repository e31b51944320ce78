"""Model sources: a built-in name, a local folder, or a hub id, resolved to what from_pretrained takes.

    >>> resolve_model("builtin:tiny-llama")  # doctest: +SKIP
    '/root/.workbench/assets/tiny-llama'
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from workbench.errors import ModelNotFoundError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_builtin(model_id: str) -> bool:
    return model_id.startswith("builtin:")


def resolve_model(model_id: str) -> str:
    """Return a folder (built-in or local) or a hub id; raise ModelNotFoundError otherwise.

    A hub id is returned as it is: whether the hub has it is only known when loading, and
    :func:`load_config` turns that failure into a ModelNotFoundError too.
    """
    if is_builtin(model_id):
        from workbench.assets import builtin_model_path
        from workbench.assets.tiny_vlm import BUILTIN_VLM, builtin_vlm_path

        if model_id == BUILTIN_VLM:
            return str(builtin_vlm_path(model_id))
        return str(builtin_model_path(model_id))
    path = Path(os.path.expanduser(model_id))
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {path} has no config.json; point model.id at a folder saved with "
                "save_pretrained (config.json, weights, tokenizer files)"
            )
        return str(path.resolve())
    if _HUB_ID.match(model_id) and not model_id.startswith((".", "/", "~")):
        return model_id
    raise ModelNotFoundError(
        f"model {model_id!r} not found: it is not a folder on this machine, not a hub id "
        "(ORG/NAME) and not a built-in (builtin:tiny-llama); fix model.id"
    )


def load_config(model_id: str, revision: str | None = None, trust_remote_code: bool = False):
    """The model's transformers config, without downloading weights."""
    from transformers import AutoConfig

    source = resolve_model(model_id)
    try:
        return AutoConfig.from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code
        )
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load the config of {model_id!r}: {exc}. If this is a hub id, check the "
            "spelling and that the hub is reachable (or download it and use the local folder)"
        ) from None


def is_vision_model(model_id: str, revision: str | None = None,
                    trust_remote_code: bool = False, local_only: bool = False) -> bool:
    """Whether the model reads images (its config has a vision config): such a run takes the
    vision path (workbench.data.vision, workbench.train.vision). A local folder's config.json is
    read as JSON, so a text run does not import transformers for the question; ``local_only``
    answers False for a hub id rather than asking the hub (for a planner's quick look)."""
    import json

    source = resolve_model(model_id)
    config_file = Path(source) / "config.json"
    if config_file.is_file():
        return "vision_config" in json.loads(config_file.read_text(encoding="utf-8"))
    if local_only:
        return False
    return getattr(load_config(model_id, revision, trust_remote_code), "vision_config",
                   None) is not None


def trainer_path(spec: Any, local_only: bool = False) -> str:
    """Which trainer a run of ``spec`` takes: ``"preference"`` (a DPO/ORPO/KTO/GRPO stage: TRL's
    trainers), ``"vision"`` (an SFT run of a model that reads images) or ``"text"``. Only the
    text path scores the spec's ``eval:`` tasks during the run (workbench.train.run), and the
    planner prices that scoring by the same answer (workbench.plan.scoring_time)."""
    if spec.method.stage != "sft":
        return "preference"
    m = spec.model
    return ("vision" if is_vision_model(m.id, m.revision, m.trust_remote_code, local_only)
            else "text")


def is_absolute_folder_id(model_id: str) -> bool:
    """``model.id`` names a folder by an absolute or ``~/`` path: a folder that may exist on a
    run's target only (workbench.targets.remote_model checks it there). A relative path is not one: it
    would mean a different folder on each machine."""
    return model_id.startswith(("/", "~"))
