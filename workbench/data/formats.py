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
    guess = suggest_columns(row)
    fix = (f"name the parts of your columns in data.sources[].columns, e.g. columns: "
           f"{{{', '.join(f'{k}: {v}' for k, v in guess.items())}}}" if guess else
           "name the parts of your columns in data.sources[].columns (prompt, response, "
           "system, messages, text, chosen, rejected)")
    raise DatasetFormatError(
        f"{where}: cannot tell the format from its columns {sorted(row)}; {fix}. Known layouts: "
        + "; ".join(f"{k} ({v})" for k, v in FIELDS.items())
    )


# Column names people give each part, most common first (for the suggestion in an error).
_LIKELY = {
    "prompt": ("prompt", "question", "query", "input", "instruction", "q", "problem", "source",
               "user", "human"),
    "response": ("response", "answer", "output", "completion", "target", "a", "solution",
                 "assistant", "reply", "gpt"),
    "system": ("system", "system_prompt"),
    "chosen": ("chosen",), "rejected": ("rejected",),
}


def suggest_columns(row: dict[str, Any]) -> dict[str, str]:
    """A guess at ``data.sources[].columns`` for a row whose layout is not a known one: which of
    its string columns look like the prompt and the response (empty when nothing fits)."""
    by_name = {str(k).strip().lower(): k for k, v in row.items() if isinstance(v, str)}
    out: dict[str, str] = {}
    for part, names in _LIKELY.items():
        hit = next((by_name[n] for n in names if n in by_name and by_name[n] not in
                    out.values()), None)
        if hit is not None:
            out[part] = hit
    return out if "prompt" in out and ("response" in out or "chosen" in out) else {}


def map_columns(row: dict[str, Any], columns: dict[str, str], where: str) -> dict[str, Any]:
    """``row`` with its columns renamed to the parts ``columns`` gives them (a source's
    ``columns``), in the layout the formats read: prompt/query/response/system become alpaca's
    instruction/input/output/system when there is a response, else the prompt stays a prompt
    (preference and GRPO data); messages become sharegpt's conversations when their turns have
    ``from``/``value``."""
    missing = [c for c in columns.values() if c not in row]
    if missing:
        raise DatasetFormatError(
            f"{where} has no column(s) {missing} (named in data.sources[].columns); its columns "
            f"are {sorted(row)}")
    out = {k: v for k, v in row.items() if k not in set(columns.values())}
    alpaca = "response" in columns
    names = {"prompt": "instruction" if alpaca else "prompt", "query": "input",
             "response": "output"}
    for part, column in columns.items():
        value = row[column]
        if part == "messages":
            first = value[0] if isinstance(value, list) and value else {}
            part = "conversations" if isinstance(first, dict) and "from" in first else "messages"
        out[names.get(part, part)] = value
    return out


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


def row_has_image(row: dict[str, Any]) -> bool:
    """Whether a row carries an image: LLaVA's or TRL's ``image``/``images``, or an image part
    in a turn's content (:mod:`workbench.data.images` reads such rows)."""
    if row.get("image") or row.get("images"):
        return True
    for key in ("messages", "conversations"):
        turns = row.get(key)
        for turn in turns if isinstance(turns, list) else []:
            content = turn.get("content") if isinstance(turn, dict) else None
            if isinstance(content, list) and any(
                    isinstance(p, dict) and p.get("type") in ("image", "image_url")
                    for p in content):
                return True
    return False


def to_example(row: dict[str, Any], fmt: str, where: str) -> dict[str, Any]:
    if row_has_image(row):  # read as text, its picture would be dropped without a word
        raise DatasetFormatError(
            f"{where}: the row holds an image, which a text model cannot read; train a "
            "vision-language model (model.id: builtin:tiny-qwen2-vl, or a hub VLM)")
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
