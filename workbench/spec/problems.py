"""From pydantic's ValidationError to the problems of a SpecError: each one a dotted field path and
what to do, with "did you mean" for a misspelt or familiar field name (``learning_rate`` -> ``lr``).
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from workbench.errors import SpecError


def problems(exc: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    """(field path, message) for each error of ``exc``, raised validating a ``root`` model."""
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, SpecError):  # RunSpec's own __init__ ran inside this validation
            out += [(".".join(filter(None, (path, p))), m) for p, m in inner.problems]
            continue
        if err["type"] == "extra_forbidden":
            msg = _unknown_field_message(root, loc)
        elif err["type"] == "literal_error":
            msg = f"got {err['input']!r}; {err['msg'].lower()}"
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
        out.append((path, msg))
    return out


# Names people bring from the Trainer or other tools, mapped to ours.
FAMILIAR = {"learning_rate": "lr", "num_train_epochs": "epochs", "gradient_accumulation_steps":
            "grad_accum", "per_device_train_batch_size": "batch_size", "r": "lora_r",
            "lora_rank": "lora_r", "gpus": "gpus_per_node", "num_nodes": "nodes"}


def _unknown_field_message(root: type[BaseModel], loc: list[str]) -> str:
    model: Any = root
    for part in loc[:-1]:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            break
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        candidates = [ann, *(inner or ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)),
                     None)
        if model is None:
            break
    allowed = sorted(model.model_fields) if model is not None else []
    name = loc[-1]
    close = [FAMILIAR[name]] if FAMILIAR.get(name) in allowed else difflib.get_close_matches(
        name, allowed, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown field '{name}'; {hint}allowed fields: {', '.join(allowed)}"
