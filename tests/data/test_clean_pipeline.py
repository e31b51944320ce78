"""The cleaning pipeline on a generated zh/en corpus with planted problems."""

from __future__ import annotations

import json
import re

import pytest

import workbench.data.clean as clean
from workbench.data.clean import CleanPipeline, build_steps, clean_records
from workbench.data.clean.corpus import generate_records
from workbench.data.clean.dedup import MinHasher, U64Set, jaccard
from workbench.data.clean.langid import detect
from workbench.data.clean.pii import PIIScrubber
from workbench.errors import DatasetFormatError, SpecError
from workbench.spec import CleanSpec, RunSpec


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return list(generate_records(800, seed=7))


@pytest.fixture(scope="module")
def cleaned(corpus: list[dict]) -> tuple[list[dict], clean.CleanReport]:
    return clean_records(corpus, workers=2, progress=False)


def test_public_surface_is_exactly_the_intended_names() -> None:
    assert {"CleanPipeline", "CleanReport", "clean_file", "clean_records",
            "NearDedup", "ExactDedup", "PIIScrubber"} <= set(clean.__all__)
    assert all(hasattr(clean, n) for n in clean.__all__)


def test_dedup_precision_and_recall_on_planted_duplicates(corpus, cleaned) -> None:
    kept, report = cleaned
    kept_ids = {r["id"] for r in kept}
    planted = {r["id"] for r in corpus if r["kind"] in ("exact_dup", "near_dup")}
    removed = {r["id"] for r in corpus if r["id"] not in kept_ids}
    by_dedup = report.step("exact_dedup").removed + report.step("near_dedup").removed
    # Everything else that was removed is a planted non-duplicate problem, so precision can be
    # measured from the counts: dedup removals that are not planted duplicates are false positives.
    true_pos = len(planted & removed)
    other_bad = {r["id"] for r in corpus if r["kind"] in ("junk", "toxic", "other_lang")}
    assert removed <= planted | other_bad, "a clean document was removed"
    precision = true_pos / by_dedup
    recall = true_pos / len(planted)
    print(f"dedup precision {precision:.3f} recall {recall:.3f} on {len(planted)} planted")
    # The targets docs/benchmarks-data.md states (it measures 1.00 / 1.00 on this corpus).
    assert precision >= 0.98
    assert recall >= 0.95
    assert report.step("exact_dedup").removed == sum(r["kind"] == "exact_dup" for r in corpus)


def test_kept_rows_keep_other_fields_and_first_occurrence(corpus, cleaned) -> None:
    kept, _ = cleaned
    originals = {r["id"] for r in corpus if r["kind"] in ("en", "zh")}
    assert originals <= {r["id"] for r in kept}  # the first of each cluster is the one kept
    assert all(set(r) == {"id", "text", "kind", "source", "pii"} for r in kept)


def test_report_counts_reasons_examples_and_languages(corpus, cleaned) -> None:
    kept, report = cleaned
    d = json.loads(json.dumps(report.to_dict()))
    assert d["complete"] and d["documents_in"] == len(corpus)
    assert d["documents_out"] == len(kept)
    assert sum(s["removed"] for s in d["steps"]) == d["removed"]
    assert d["languages_in"]["en"] > 0 and d["languages_in"]["zh"] > 0
    assert sum(d["length_histogram"]["in"]) == len(corpus)
    tox = report.step("toxicity")
    assert tox.removed == sum(r["kind"] == "toxic" for r in corpus)
    assert tox.examples and tox.examples[0]["reason"] == "wordlist"
    assert report.step("pii").modified == sum(r["kind"] == "pii" for r in corpus)
    assert "near_dedup" in report.summary()
    again = clean.CleanReport.from_dict(d).to_dict()
    assert {**again, "docs_per_second": None} == {**d, "docs_per_second": None}


def test_planted_pii_is_gone_from_kept_rows(corpus, cleaned) -> None:
    kept, _ = cleaned
    pii_rows = [r for r in kept if r["pii"]]
    assert pii_rows
    for r in pii_rows:
        for value in r["pii"]:
            assert value not in r["text"]


def test_the_report_shows_a_rewrite_before_and_after_with_the_change_marked(corpus,
                                                                           cleaned) -> None:
    kept, report = cleaned
    rewrites = report.step("pii").rewrites
    assert rewrites
    planted = [v for r in corpus if r["pii"] for v in r["pii"]]
    for r in rewrites:
        # Before holds a planted value, after no longer does, and the two differ only there.
        values = [v for v in planted if v in r["before"]]
        assert values and not any(v in r["after"] for v in values)
    html = report.rewrites_html()
    first = next(v for v in planted if v in rewrites[0]["before"])
    # The planted value is inside a <del> on the before side (word-level marking).
    dels = re.findall(r"<del [^>]*>(.*?)</del>", html)
    assert any(first.split()[0] in d for d in dels), (first, dels[:5])
    assert re.findall(r"<ins [^>]*>(.*?)</ins>", html)
    again = clean.CleanReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.step("pii").rewrites == rewrites


# PII forms are measured on hand-written text in test_clean_realworld.py, not on samples
# generated in the very forms the regexes target.
def test_pii_leaves_ordinary_numbers_alone() -> None:
    text = "In 2024 we sold 1234567890123 units at 12.50 each, version 1.2.3.4.5, at 12:30:45."
    assert PIIScrubber().scrub(text) == (text, {})


def test_language_id_on_mixed_zh_en() -> None:
    rows = [r for r in generate_records(200, seed=3) if r["kind"] in ("en", "zh", "other_lang")]
    expected = {"en": "en", "zh": "zh", "other_lang": "fr"}
    hits = sum(detect(r["text"])[0] == expected[r["kind"]] for r in rows)
    assert hits / len(rows) >= 0.98
    assert detect("今天天气很好，我们去公园散步吧。")[0] == "zh"
    assert detect("The weather is nice today, let us take a walk in the park.")[0] == "en"


def test_minhash_estimates_jaccard_and_separates_unrelated_texts() -> None:
    import random

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    a = [rng.choice(vocab) for _ in range(400)]
    b = list(a)
    for i in rng.sample(range(400), 8):
        b[i] = rng.choice(vocab)
    mh = MinHasher(num_perm=256, bands=32, shingle_size=5)
    sh = lambda ws: {" ".join(ws[i:i + 5]) for i in range(len(ws) - 4)}  # noqa: E731
    true = jaccard(sh(a), sh(b))
    est = float((mh.signature(" ".join(a)) == mh.signature(" ".join(b))).mean())
    assert abs(est - true) < 0.08
    c = [rng.choice(vocab) for _ in range(400)]
    assert float((mh.signature(" ".join(a)) == mh.signature(" ".join(c))).mean()) < 0.05


def test_minhash_words_are_cjk_aware_and_position_independent() -> None:
    mh = MinHasher()
    ids = mh.word_ids("Data 数据 data, 数据!")
    assert len(ids) == 6
    assert ids[0] == ids[3] and ids[1] == ids[4] and ids[2] == ids[5]


def test_u64set_grows_and_remembers() -> None:
    s = U64Set(capacity=16)
    for k in range(1, 2000):
        assert not s.seen([k * 7919, k * 104729 + 1])
    assert s.seen([7919 * 5]) and len(s) == 2 * 1999


def test_workers_give_the_same_result_as_one_process(corpus) -> None:
    one, r1 = clean_records(corpus[:300], workers=1, progress=False)
    two, r2 = clean_records(corpus[:300], workers=2, progress=False, batch_size=16)
    assert one == two
    assert [s.to_dict() for s in r1.steps] == [s.to_dict() for s in r2.steps]


def test_from_spec_validates_names_and_options() -> None:
    spec = RunSpec(data={"clean": {"enabled": True, "steps": ["normalize", "pii"],
                                   "options": {"pii": {"kinds": ["email"]}}}})
    pipeline = CleanPipeline.from_spec(spec.data.clean, workers=1, progress=False)
    rows, report = pipeline.run([{"instruction": "mail x@y.org", "output": "13812345678"}],
                                text_fields=["instruction", "output"])
    assert list(rows) == [{"instruction": "mail <EMAIL>", "output": "13812345678"}]
    assert report.to_dict()["documents_out"] == 1
    assert [s.name for s in CleanPipeline.from_spec(CleanSpec()).steps] == list(
        clean.DEFAULT_STEPS)
    with pytest.raises(SpecError, match="unknown step 'x'; known: normalize"):
        CleanPipeline.from_spec(CleanSpec(steps=["normalize", "x"]))
    with pytest.raises(SpecError, match=r"data.clean.options.near_dedup: unknown option"):
        build_steps(None, {"near_dedup": {"shingles": 3}})
    with pytest.raises(SpecError, match="threshold must be between 0 and 1"):
        build_steps(None, {"near_dedup": {"threshold": 2}})


def test_threshold_picks_bands() -> None:
    step = build_steps(["near_dedup"], {"near_dedup": {"threshold": 0.5, "num_perm": 64}})[0]
    assert step.bands * step.rows <= 64 and step.bands > 8  # lower threshold: more, shorter bands


def test_run_rejects_bad_rows() -> None:
    rows, _ = CleanPipeline.from_names(["normalize"], workers=1, progress=False).run(
        [{"text": "ok"}, ["not", "a", "dict"]])
    with pytest.raises(DatasetFormatError, match="row 2 is not a JSON object"):
        list(rows)
