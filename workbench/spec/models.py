"""Model sources: a built-in name, a local folder, or a hub id, resolved to what from_pretrained takes.

    >>> resolve_model("builtin:tiny-llama")  # doctest: +SKIP
    '/root/.workbench/assets/tiny-llama'
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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


def is_absolute_folder_id(model_id: str) -> bool:
    """``model.id`` names a folder by an absolute or ``~/`` path: a folder that may exist on a
    run's target only (workbench.targets.remote_model checks it there). A relative path is not one: it
    would mean a different folder on each machine."""
    return model_id.startswith(("/", "~"))
