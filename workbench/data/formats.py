"""Normalise dataset rows to one shape: ``{"messages": [{"role", "content"}, ...]}`` or ``{"text"}``.

Formats:
  alpaca    instruction, input (optional), output, system (optional)
  sharegpt  conversations: [{"from": "human" | "gpt" | "system", "value"}]
  messages  messages: [{"role": "system" | "user" | "assistant", "content"}]  (OpenAI chat)
  text      text  (plain language modelling, loss on every token)

    >>> to_example({"instruction": "Opposite of up?", "output": "down"}, "alpaca", "line 1")
    {'messages': [{'role': 'user', 'content': 'Opposite of up?'}, {'role': 'assistant', 'content': 'down'}]}
"""

from __future__ import annotations

from typing import Any

from workbench.errors import DatasetFormatError

FIELDS = {
    "alpaca": "instruction/input/output",
    "sharegpt": "conversations (a list of {from, value})",
    "messages": "messages (a list of {role, content})",
    "text": "text",
}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def detect_format(row: dict[str, Any], where: str) -> str:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    raise DatasetFormatError(
        f"{where}: cannot tell the format from its fields {sorted(row)}; expected one of: "
        + "; ".join(f"{k} ({v})" for k, v in FIELDS.items())
        + ". Rename the fields or set data.sources[].format"
    )


def _missing(where: str, fmt: str, field: str) -> DatasetFormatError:
    return DatasetFormatError(
        f'{where} has no "{field}" field (expected {fmt} format: {FIELDS[fmt]})'
    )


def _str(row: dict[str, Any], field: str, where: str, fmt: str, required: bool = True) -> str:
    value = row.get(field)
    if value is None:
        if required:
            raise _missing(where, fmt, field)
        return ""
    if not isinstance(value, str):
        raise DatasetFormatError(
            f'{where}: field "{field}" must be a string, got {type(value).__name__}'
        )
    return value


def to_example(row: dict[str, Any], fmt: str, where: str) -> dict[str, Any]:
    if fmt == "auto":
        fmt = detect_format(row, where)
    if fmt == "alpaca":
        instruction = _str(row, "instruction", where, fmt)
        extra = _str(row, "input", where, fmt, required=False)
        output = _str(row, "output", where, fmt)
        system = _str(row, "system", where, fmt, required=False)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        msgs = [{"role": "system", "content": system}] if system else []
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return {"messages": msgs}
    if fmt in _TURN_KEYS:
        return {"messages": _turns(row, fmt, where)}
    if fmt == "text":
        return {"text": _str(row, "text", where, fmt)}
    raise DatasetFormatError(f"{where}: unknown format {fmt!r}; use one of {', '.join(FIELDS)}")


# format -> (list field, speaker key, text key, speaker name -> role)
_TURN_KEYS = {
    "sharegpt": ("conversations", "from", "value", _SHAREGPT_ROLES),
    "messages": ("messages", "role", "content",
                 {"system": "system", "user": "user", "assistant": "assistant"}),
}


def _turns(row: dict[str, Any], fmt: str, where: str) -> list[dict[str, str]]:
    field, who, text, roles = _TURN_KEYS[fmt]
    turns = row.get(field)
    if turns is None:
        raise _missing(where, fmt, field)
    msgs = []
    for i, turn in enumerate(turns if isinstance(turns, list) else [None]):
        if not isinstance(turn, dict) or who not in turn or text not in turn:
            raise DatasetFormatError(
                f'{where}: {field}[{i}] must be an object with "{who}" and "{text}"'
            )
        role = roles.get(str(turn[who]).lower())
        if role is None:
            raise DatasetFormatError(
                f"{where}: {field}[{i}] has unknown speaker {turn[who]!r}; use "
                f"{', '.join(sorted(set(roles)))}"
            )
        msgs.append({"role": role, "content": str(turn[text])})
    return _checked(msgs, where, fmt)


def _checked(msgs: list[dict[str, str]], where: str, fmt: str) -> list[dict[str, str]]:
    if not any(m["role"] == "assistant" for m in msgs):
        raise DatasetFormatError(
            f"{where}: the conversation has no assistant turn, so there is nothing to learn "
            f"(expected {fmt} format: {FIELDS[fmt]})"
        )
    return msgs


def example_text(example: dict[str, Any]) -> str:
    """The text of an example, for cleaning, hashing and previews."""
    if "text" in example:
        return str(example["text"])
    return "\n".join(m["content"] for m in example["messages"])
