"""The fast paths of the cleaning steps give exactly what the plain definitions give."""

from __future__ import annotations

import random
import re

import pytest

from workbench.data.clean import normalize as norm
from workbench.data.clean.corpus import pii_samples
from workbench.data.clean.pii import PII_KINDS, PIIScrubber
from workbench.data.clean.quality import (
    _dup_ngram_char_fraction,
    _NGrams,
    _top_ngram_char_fraction,
)
from workbench.data.clean.step import Doc
from workbench.data.clean.toxicity import ToxicityFilter


def _word_lists(seed: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        vocab = ["".join(rng.choice("abcdefg") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.choice([1, 2, 3, 5, 20, 200]))]
        out.append([rng.choice(vocab) for _ in range(rng.randint(0, 60))])
    return out


def test_ngram_statistics_equal_the_counter_definitions() -> None:
    for ws in _word_lists(0, 1500):
        total = sum(map(len, ws))
        grams = _NGrams(ws, total)
        for k in random.Random(len(ws)).sample(range(1, 12), 11):  # any order of n
            top = grams.top_fraction(k)
            assert top == _top_ngram_char_fraction(ws, k, total)
            assert grams.dup_fraction(k) == _dup_ngram_char_fraction(ws, k, total)
            assert grams.top_bound(k) >= top


def test_ngram_keys_renumber_when_the_vocabulary_is_large() -> None:
    rng = random.Random(1)
    ws = [str(rng.randrange(70_000)) for _ in range(3000)]
    ws += ws[100:400]  # a repeated stretch
    total = sum(map(len, ws))
    grams = _NGrams(ws, total)
    for k in (2, 5, 7, 10):
        assert grams.top_fraction(k) == _top_ngram_char_fraction(ws, k, total)
        assert grams.dup_fraction(k) == _dup_ngram_char_fraction(ws, k, total)
    assert grams.dup_fraction(10) > 0


def test_ngram_size_below_one_fails_as_before() -> None:
    grams = _NGrams(["a", "b"], 2)
    with pytest.raises(IndexError):
        grams.top_fraction(0)
    with pytest.raises(IndexError):
        _top_ngram_char_fraction(["a", "b"], 0, 2)


def _scrub_every_pattern(text: str) -> str:
    for _kind, pattern, valid in PII_KINDS:
        def sub(m: re.Match[str], valid=valid, kind=_kind) -> str:
            return m.group(0) if valid is not None and not valid(m.group(0)) else f"<{kind}>"
        text = pattern.sub(sub, text)
    return text


def test_pii_gates_skip_only_patterns_that_cannot_match() -> None:
    rng = random.Random(5)
    scrubber = PIIScrubber(replacements={k: f"<{k}>" for k in
                                         ("email", "phone", "ip_address", "id_number",
                                          "card_number")})
    pieces = ["a@b", "x@y.cn", "1.2.3.4", "::1", "fe80::1", "2001:db8::ff00:42:8329",
              "+86 138 1234 5678", "(555) 123-4567", "010-12345678", "123-45-6789", "word",
              "的", " ", "-", ".", ":"]
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 12)):
            c = rng.random()
            if c < 0.3:
                parts.append(rng.choice(list(pii_samples(rng).values())))
            elif c < 0.6:
                parts.append("".join(rng.choice("0123456789 -.+()@:") for _ in
                                     range(rng.randint(1, 25))))
            else:
                parts.append(rng.choice(pieces))
        text = rng.choice(["", " "]).join(parts)
        assert scrubber.scrub(text)[0] == _scrub_every_pattern(text), text


def _normalize_always(step: norm.Normalize, text: str) -> str:
    import unicodedata

    if step.form != "none":
        text = unicodedata.normalize(step.form, text)
    text = norm._INVISIBLE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    if step.collapse_spaces:
        text = norm._TRAILING.sub("\n", norm._SPACES.sub(" ", text))
    return step._too_many.sub(step._blank, text).strip()


def test_normalize_skips_only_substitutions_that_change_nothing() -> None:
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "  ", "\t", "\n", "\r", "\r\n", "\u3000", "\u00a0", "\u200b",
                "\x0c", "\u2009", "é", "e\u0301", "中", " \n", "\n\n\n"]
    for opts in ({}, {"max_blank_lines": 0}, {"max_blank_lines": 3}, {"collapse_spaces": False},
                 {"form": "NFKC"}):
        step = norm.Normalize(**opts)
        for _ in range(2000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            assert step.normalize(text) == _normalize_always(step, text), (opts, text)


@pytest.mark.parametrize("text", ["Shit, this SHIT is ok", "İstanbul shit", "K shit 傻逼",
                                  "plain words only"])
def test_toxicity_with_shared_words_equals_its_own_words(text: str) -> None:
    tox = ToxicityFilter()
    doc = Doc({"text": text})
    assert tox.hits(text, doc.lower_words()) == tox.hits(text)


def test_minhash_signature_in_blocks_equals_the_whole_matrix() -> None:
    import numpy as np

    from workbench.data.clean.dedup import MinHasher

    mh = MinHasher()
    rng = random.Random(3)
    for n_words in (0, 1, 4, 255, 256, 257, 600, 2000):
        text = " ".join(f"w{rng.randrange(500)}" for _ in range(n_words))
        x = mh.shingles(text)
        whole = np.multiply.outer(x, mh._a)
        whole += mh._b
        assert (mh.signature(text) == whole.min(axis=0) >> np.uint64(32)).all()
