"""Long multi-turn conversations under keep_response: the system turn and the latest exchanges
stay, the oldest exchanges go first (whole), and every assistant turn kept is trained."""

from __future__ import annotations

import json

import pytest

from workbench.data.tokenize import IGNORE, encode_batch
from workbench.spec import RunSpec

SYSTEM = {"role": "system", "content": "You are a terse farmyard guide."}
EXCHANGES = [
    ("What does a cow say?", "moo"),
    ("And a dog, when it hears the postman?", "woof woof"),
    ("A cat at night?", "meow"),
    ("Finally, a sheep standing in a cold field in the rain, wet and tired, far from the "
     "barn, on a grey afternoon?", "baa"),
]
CONVERSATION = [SYSTEM] + [
    {"role": r, "content": c} for q, a in EXCHANGES for r, c in (("user", q), ("assistant", a))]

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(params=["builtin", "chatml"])
def tok(request, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    if request.param == "chatml":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
        tok.eos_token = "<|im_end|>"
    tok.end_marker = {"builtin": "<|end|>", "chatml": "<|im_end|>"}[request.param]
    return tok


def _kept(last: int) -> list[dict[str, str]]:
    """The system turn and the last ``last`` exchanges, as a user would cut them by hand."""
    return [SYSTEM] + CONVERSATION[1 + 2 * (len(EXCHANGES) - last):]


def _ids(tok, messages) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False),
               add_special_tokens=False)["input_ids"]


def _trained(enc, tok) -> list[str]:
    runs, current = [], []
    for t, lab in zip(enc.input_ids + [None], enc.labels + [IGNORE]):
        if lab == IGNORE:
            if current:
                runs.append(tok.decode(current))
            current = []
        else:
            assert lab == t  # a trained token is trained on itself
            current.append(t)
    return runs


def test_oldest_exchanges_go_first_and_every_kept_answer_is_trained(tok):
    full, two, one = (_ids(tok, _kept(n)) for n in (4, 2, 1))
    answers = [a + tok.end_marker for _, a in EXCHANGES]
    # Fits whole: untouched, all four answers trained.
    enc = encode_batch([{"messages": CONVERSATION}], tok, len(full))[0]
    assert enc.input_ids == full and not enc.truncated and _trained(enc, tok) == answers
    # Room for the system turn and two exchanges: exactly those, token for token.
    enc = encode_batch([{"messages": CONVERSATION}], tok, len(two))[0]
    assert enc.input_ids == two and enc.truncated
    assert _trained(enc, tok) == answers[2:]
    assert [lab for lab in enc.labels if lab == IGNORE] and all(
        lab in (IGNORE, t) for t, lab in zip(enc.input_ids, enc.labels))
    # One token short of that: the next oldest exchange goes too.
    enc = encode_batch([{"messages": CONVERSATION}], tok, len(two) - 1)[0]
    assert enc.input_ids == one and _trained(enc, tok) == answers[3:]
    # Statistics describe the whole conversation, before truncation.
    assert enc.prompt_tokens + enc.response_tokens == len(full)


def test_last_exchange_too_long_keeps_system_turn_and_answer_and_cuts_the_question(tok):
    one = _ids(tok, _kept(1))
    system = _ids(tok, [SYSTEM])
    limit = len(one) - 10
    enc = encode_batch([{"messages": CONVERSATION}], tok, limit)[0]
    assert len(enc.input_ids) == limit and enc.truncated
    assert _trained(enc, tok) == [EXCHANGES[-1][1] + tok.end_marker]
    assert enc.input_ids[:len(system)] == system  # the system turn, whole
    # What goes is the start of the question, right after the system turn.
    assert enc.input_ids[len(system):] == one[len(system) + 10:]


def test_counts_of_truncated_and_dropped_conversations(tok, tmp_path):
    from workbench.data.tokenized import tokenize_split

    two = _ids(tok, _kept(2))
    rows = [{"messages": CONVERSATION}] * 3 + [{"messages": _kept(1)}] * 2
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = RunSpec(data={"sources": [{"path": str(path)}], "max_length": len(two)})
    table, stats = tokenize_split(path, spec, tok)
    assert (stats.examples, stats.truncated, stats.dropped) == (5, 3, 0)
    assert table.column("input_ids").to_pylist()[:3] == [two] * 3
    # Cutting the end instead keeps the first exchanges' answers: truncated, not dropped, until
    # max_length leaves no answer at all.
    system_and_question = len(_ids(tok, _kept(4)[:2]))
    right = RunSpec(data={**spec.data.model_dump(), "truncation": "right",
                          "max_length": system_and_question})
    _table, stats = tokenize_split(path, right, tok)
    assert (stats.examples, stats.truncated, stats.dropped) == (5, 0, 5)
