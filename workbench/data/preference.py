"""Preference and prompt data for the stages after SFT: read, detect, normalise, check, split.

The counterpart of :mod:`workbench.data.formats` + :mod:`workbench.data.prepare` for
``method.stage`` dpo/orpo (pairs), kto (unpaired) and grpo (prompts). Every row is normalised to
TRL's conversational layout, so the model's chat template renders it exactly as SFT and serving do:

  pairs     {"prompt": [messages], "chosen": [assistant turn], "rejected": [assistant turn]}
  unpaired  {"prompt": [messages], "completion": [assistant turn], "label": bool}
  prompts   {"prompt": [messages], ...the row's other plain columns (reward references)}

Accepted inputs: ``prompt``/``chosen``/``rejected`` as text or message lists, chosen/rejected as
whole conversations that share the prompt (the implicit-prompt hub layout, e.g. UltraFeedback),
``question``/``response_chosen``/... aliases, ``prompt``/``completion``/``label`` for KTO (pairs
are unpaired into one liked and one disliked row), and for GRPO a ``prompt`` column or SFT rows
(alpaca, messages, sharegpt: the last assistant turn becomes the ``answer`` column). Launch calls
:func:`prepare_preference_data`, so a bad row fails the launch cell with
:class:`~workbench.errors.PreferenceDataError` before any process starts.

    >>> row = {"prompt": "Opposite of up?", "chosen": "down", "rejected": "up"}
    >>> normalise(row, "dpo", "line 1")[0]["chosen"]
    [{'role': 'assistant', 'content': 'down'}]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.data.formats import FIELDS as SFT_FIELDS
from workbench.data.formats import detect_format, to_example
from workbench.data.sources import read_rows
from workbench.data.split import SplitWriter
from workbench.errors import DatasetError, PreferenceDataError
from workbench.spec import RunSpec

FIELDS = {
    "pairs": "prompt/chosen/rejected (text or message lists)",
    "unpaired": "prompt/completion/label (label true for a liked completion)",
    "prompts": "prompt (text or a message list), plus the columns your rewards read",
}
# What each stage trains on; KTO also takes pairs (one liked and one disliked row each), GRPO
# also takes SFT rows (the reference answer becomes the "answer" column).
ACCEPTS = {"dpo": ("pairs",), "orpo": ("pairs",), "kto": ("unpaired", "pairs"),
           "grpo": ("prompts", "alpaca", "sharegpt", "messages")}
_NEEDS = {"dpo": "pairs", "orpo": "pairs", "kto": "unpaired", "grpo": "prompts"}
# Hub layouts name the same fields differently; the first present wins.
_ALIASES = {
    "prompt": ("prompt", "question", "instruction", "input"),
    "chosen": ("chosen", "response_chosen", "chosen_response", "response_j"),
    "rejected": ("rejected", "response_rejected", "rejected_response", "response_k"),
}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}


def _field(row: dict[str, Any], name: str) -> Any:
    return next((row[k] for k in _ALIASES.get(name, (name,)) if row.get(k) is not None), None)


def detect(row: dict[str, Any], where: str) -> str:
    """The row's format: pairs, unpaired, prompts, or one of the SFT formats."""
    if _field(row, "chosen") is not None or _field(row, "rejected") is not None:
        return "pairs"
    if "completion" in row and "label" in row:
        return "unpaired"
    if "prompt" in row:
        return "prompts"
    return detect_format(row, where)


def _messages(value: Any, where: str, field: str, role: str) -> list[dict[str, str]]:
    """Text (one turn of ``role``) or a message list ({role, content} or {from, value})."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise PreferenceDataError(
            f'{where}: field "{field}" must be text or a non-empty list of messages, got '
            f"{type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        who = m.get("role", m.get("from")) if isinstance(m, dict) else None
        text = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if _ROLES.get(str(who).lower()) is None or not isinstance(text, str):
            raise PreferenceDataError(
                f'{where}: {field}[{i}] must be a message {{"role": "user"|"assistant"|"system", '
                f'"content": "..."}}')
        out.append({"role": _ROLES[str(who).lower()], "content": text})
    return out


def _require(row: dict[str, Any], name: str, where: str, fmt: str) -> Any:
    value = _field(row, name)
    if value is None:
        raise PreferenceDataError(
            f'{where} has no "{name}" field (expected {fmt} format: {FIELDS[fmt]})')
    return value


def _pair(row: dict[str, Any], where: str) -> dict[str, Any]:
    chosen = _messages(_require(row, "chosen", where, "pairs"), where, "chosen", "assistant")
    rejected = _messages(_require(row, "rejected", where, "pairs"), where, "rejected", "assistant")
    raw_prompt = _field(row, "prompt")
    prompt = _messages(raw_prompt, where, "prompt", "user") if raw_prompt is not None else []
    # Whole conversations (the implicit-prompt layout): the shared turns before the answers.
    shared = 0
    while (shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]):
        shared += 1
    if shared:
        prompt = chosen[:shared] if not prompt or prompt == chosen[:len(prompt)] else prompt
        chosen, rejected = chosen[shared:], rejected[shared:]
    elif prompt and len(chosen) > len(prompt) and chosen[:len(prompt)] == prompt:
        chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    if not prompt:
        raise PreferenceDataError(
            f'{where} has no "prompt" field and its chosen/rejected share no opening turns '
            f"(expected pairs format: {FIELDS['pairs']})")
    if chosen == rejected:
        raise PreferenceDataError(
            f"{where}: chosen and rejected are the same, so there is no preference to learn; "
            "fix or drop the row")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _unpaired(row: dict[str, Any], where: str) -> dict[str, Any]:
    prompt = _messages(_require(row, "prompt", where, "unpaired"), where, "prompt", "user")
    completion = _messages(_require(row, "completion", where, "unpaired"), where, "completion",
                           "assistant")
    label = _require(row, "label", where, "unpaired")
    if label not in (True, False, 0, 1):  # True == 1, False == 0
        raise PreferenceDataError(
            f'{where}: "label" must be true/false (or 1/0) for a liked/disliked completion, '
            f"got {label!r}")
    return {"prompt": prompt, "completion": completion, "label": bool(label)}


def _prompt_row(row: dict[str, Any], fmt: str, where: str) -> dict[str, Any]:
    if fmt == "prompts":
        prompt = _messages(_require(row, "prompt", where, "prompts"), where, "prompt", "user")
        extra = {k: v for k, v in row.items() if k != "prompt"}
    else:  # SFT rows: the demonstration's answer is the reference a reward can compare to
        msgs = to_example(row, fmt, where)["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompt, extra = msgs[:last], {"answer": msgs[last]["content"]}
        if not prompt:
            raise PreferenceDataError(f"{where}: the conversation has no turn before the answer "
                                      "to use as the prompt")
    plain = {k: v for k, v in extra.items() if isinstance(v, (str, int, float, bool))}
    return {"prompt": prompt, **plain}


def normalise(row: dict[str, Any], stage: str, where: str,
              fmt: str = "auto") -> list[dict[str, Any]]:
    """The training rows (one, or two when KTO unpairs a pair) of one input row for ``stage``."""
    if fmt == "auto":
        fmt = detect(row, where)
    if fmt not in ACCEPTS[stage]:
        got = FIELDS.get(fmt) or SFT_FIELDS.get(fmt, fmt)
        hint = ("set method.stage: sft to train on demonstrations, or give "
                if fmt in SFT_FIELDS else "give ")
        raise PreferenceDataError(
            f"{where} looks like {fmt} data ({got}), which method.stage {stage} cannot train on: "
            f"{stage} needs {_NEEDS[stage]} ({FIELDS[_NEEDS[stage]]}); {hint}rows with those "
            "fields or set data.sources[].format")
    if fmt == "pairs":
        pair = _pair(row, where)
        if stage != "kto":
            return [pair]
        return [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]
    if fmt == "unpaired":
        return [_unpaired(row, where)]
    return [_prompt_row(row, fmt, where)]


def prepare_preference_data(spec: RunSpec, out_dir: str | Path) -> Any:
    """Write ``train.jsonl``/``validation.jsonl`` of normalised rows (split by prompt, so one
    prompt never lands on both sides), check the GRPO rewards against the data and copy the
    user rewards' modules beside the rows (``rewards/``), so they travel with the run."""
    from workbench.data.prepare import DataSummary

    stage = spec.method.stage
    if spec.data.clean.enabled:
        raise DatasetError(f"data.clean works on SFT text; for method.stage {stage} clean the "
                           "data first (workbench.data) and set data.clean.enabled: false")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns: set[str] | None = None
    with SplitWriter(out, spec.data.validation_fraction, spec.train.seed) as writer:
        for source in spec.data.sources:
            n, fmt = 0, str(source.format)
            for where, row in read_rows(source):
                if fmt == "auto":  # decided on the first row, as for SFT data
                    fmt = detect(row, where)
                for ex in normalise(row, stage, where, fmt):
                    writer.write(json.dumps(ex["prompt"], sort_keys=True), ex)
                    columns = set(ex) if columns is None else columns & set(ex)
                n += 1
            writer.end_source(source.path, n)
    if stage == "grpo":
        from workbench.train.rewards import SHIPPED_DIR, check_rewards, ship_rewards

        check_rewards(spec.method.rewards, columns or set())
        ship_rewards(spec.method.rewards, out / SHIPPED_DIR)  # travels with the run directory
    summary = DataSummary(counts=writer.counts, per_source=writer.per_source,
                          preview=writer.preview)
    (out / "summary.json").write_text(json.dumps({**summary.to_dict(), "stage": stage},
                                                 indent=1), encoding="utf-8")
    return summary
