"""Near-duplicate removal on hand-written documents that overlap the way real ones do.

The paragraphs below were written for this test; documents are three of them, so many pairs
share one paragraph and some share two, and the near-duplicates are copies with a few words
changed. Similarities are checked against exact word 5-gram Jaccard computed here with plain
Python sets, never against the filter's own estimates.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from workbench.data.clean import CleanReport, build_steps, clean_records
from workbench.errors import SpecError

PARAGRAPHS = [
    "The village library opens at nine on weekdays and closes early on Saturdays. Volunteers "
    "sort the returned books every morning, and the children's corner fills up after school "
    "when parents collect their kids from the bus stop across the road. A small cafe in the "
    "lobby sells tea, soup and sandwiches made by a bakery two streets away.",
    "Our hiking group meets at the old railway bridge on the first Sunday of each month. We "
    "walk about twelve kilometres along the river, stop for lunch at the ruined mill, and come "
    "back through the pine forest before dark. Bring water, a rain jacket and shoes with a "
    "good grip, because the path near the waterfall is slippery all year.",
    "To repair a dripping tap, first close the valve under the sink and open the tap to drain "
    "the pipe. Unscrew the handle, remove the worn washer with a flat screwdriver and fit a new "
    "one of the same size. Most hardware stores sell mixed packs of washers for less than the "
    "price of a coffee, so keep one in the drawer.",
    "The museum's new exhibition follows the history of printing from carved wooden blocks to "
    "the steam presses of the nineteenth century. Visitors can set a line of metal type by hand "
    "and print a postcard to take home. Guided tours run every hour, and the last entry is "
    "forty minutes before the doors close in the evening.",
    "Tomatoes grow best in a sunny spot sheltered from strong wind. Water them deeply twice a "
    "week rather than a little every day, so the roots go down into the soil. Pinch out the "
    "side shoots as the plants climb, tie the main stem to a cane, and feed them with a liquid "
    "fertiliser once the first flowers appear.",
    "The council has approved a plan to turn the empty car park behind the market into a small "
    "public garden with benches, fruit trees and a playground. Work is expected to start in the "
    "spring and to take about six months. Residents can comment on the design at the town hall "
    "until the end of the month.",
    "When you learn a new language, short daily practice beats long sessions once a week. Read "
    "a page of a simple book aloud, write three sentences about your day, and listen to a "
    "podcast while you cook dinner. Mistakes are part of the process, and speaking with real "
    "people early helps far more than memorising long word lists.",
    "The night train leaves the capital at ten in the evening and reaches the coast shortly "
    "after sunrise. Sleeper cabins have two narrow beds, a washbasin and a window that opens a "
    "little. Breakfast is served in the dining car, and the conductor will wake you half an "
    "hour before your station if you ask when boarding.",
    "Bread dough needs time more than effort. Mix flour, water, salt and a little yeast, leave "
    "it covered overnight in a cool kitchen, then fold it gently a few times and shape a round "
    "loaf. Bake it in a very hot oven inside a heavy pot with a lid, and let it cool completely "
    "before cutting so the crumb can set.",
    "Cycling to work saves money and keeps you fit, but it takes some planning. Choose quiet "
    "streets over the fastest route, keep a spare inner tube and a small pump in your bag, and "
    "leave a change of clothes at the office. In winter, bright lights at the front and back "
    "matter more than any reflective vest you could buy.",
]
REPLACEMENTS = ["lantern", "harbour", "quietly", "orange", "seven", "meadow", "copper",
                "winter", "ladder", "violet", "gravel", "thunder", "pepper", "candle"]
SHINGLE = 5


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingle_set(text: str) -> set[tuple[str, ...]]:
    ws = words(text)
    return {tuple(ws[i:i + SHINGLE]) for i in range(len(ws) - SHINGLE + 1)}


def exact_jaccard(a: str, b: str) -> float:
    x, y = shingle_set(a), shingle_set(b)
    return len(x & y) / len(x | y)


def doc(*paragraphs: int) -> str:
    return "\n\n".join(PARAGRAPHS[p] for p in paragraphs)


def with_edits(text: str, n_edits: int, offset: int = 0) -> str:
    """``text`` with ``n_edits`` words, spread evenly over it, replaced by other words."""
    tokens = text.split(" ")
    for m in range(n_edits):
        i = int((m + 0.5) * len(tokens) / n_edits)
        tokens[i] = REPLACEMENTS[(m + offset) % len(REPLACEMENTS)]
    return " ".join(tokens)


def overlap_corpus() -> list[str]:
    """Originals sharing one or two paragraphs, true near-duplicates, and a run of copies of
    the first document with more and more words changed, from clearly similar to clearly not."""
    docs = [doc(0, 1, 2), doc(3, 4, 5), doc(0, 6, 7), doc(1, 6, 8), doc(3, 4, 9),
            with_edits(doc(0, 1, 2), 3),  # a true near-duplicate of row 1
            doc(6, 7, 0),                 # row 3's paragraphs in another order
            doc(2, 5, 8),
            with_edits(doc(3, 4, 5), 2, offset=5),  # a true near-duplicate of row 2
            doc(0, 1, 9), doc(7, 8, 9), doc(2, 3, 6)]
    docs += [with_edits(doc(0, 1, 2), k, offset=k) for k in range(4, 26)]
    return docs


def best_earlier(docs: list[str], i: int, among: list[int] | None = None) -> tuple[float, int]:
    """(highest exact Jaccard of docs[i] with an earlier document, that document's index)."""
    earlier = [j for j in (among if among is not None else range(i)) if j < i]
    return max(((exact_jaccard(docs[i], docs[j]), j) for j in earlier), default=(0.0, -1))


def run(docs: list[str], **options: object) -> tuple[set[int], CleanReport]:
    rows = [{"n": i, "text": t} for i, t in enumerate(docs)]
    kept, report = clean_records(rows, steps=["near_dedup"], options={"near_dedup": options},
                                 workers=1, progress=False)
    return set(range(len(docs))) - {r["n"] for r in kept}, report


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = overlap_corpus()
    # The fixture really has the overlap it claims: shared paragraphs, and near-duplicates
    # on both sides of 0.75.
    sims = [best_earlier(docs, i)[0] for i in range(1, len(docs))]
    assert sum(0.1 < s < 0.6 for s in sims) >= 5
    assert sum(0.6 <= s < 0.75 for s in sims) >= 4
    assert sum(s >= 0.75 for s in sims) >= 5
    return docs


def test_removes_only_documents_at_or_above_the_threshold(corpus: list[str]) -> None:
    removed, _ = run(corpus, threshold=0.75)
    for i in removed:
        sim, j = best_earlier(corpus, i)
        assert sim >= 0.75, f"row {i + 1} removed but its best earlier match (row {j + 1}) " \
                            f"has Jaccard {sim:.3f}"
    assert {5, 6, 8} <= removed  # the three planted near-duplicates
    kept = sorted(set(range(len(corpus))) - removed)
    for i in kept:  # nothing kept is clearly a near-duplicate of an earlier kept document
        sim, j = best_earlier(corpus, i, among=kept)
        assert sim < 0.8, f"row {i + 1} kept, Jaccard {sim:.3f} with kept row {j + 1}"


def test_report_names_the_kept_document_and_its_similarity(corpus: list[str]) -> None:
    removed, report = run(corpus, threshold=0.75)
    step = report.step("near_dedup")
    named = {row - 1: (kept - 1, sim, method) for row, kept, sim, method in step.duplicates}
    assert set(named) == removed
    assert named[5][0] == 0 and named[6][0] == 2 and named[8][0] == 1
    for i, (k, sim, method) in named.items():
        assert k < i and k not in removed
        # Every document here has fewer distinct 5-grams than a sketch holds (256): the
        # similarity is computed, not estimated, and matches plain sets to the report's 4 places.
        assert method == "exact"
        assert sim == pytest.approx(exact_jaccard(corpus[i], corpus[k]), abs=5e-5)
    d = json.loads(json.dumps(report.to_dict()))
    pairs = next(s for s in d["steps"] if s["name"] == "near_dedup")["duplicates"]
    assert {(p["row"], p["kept_row"]) for p in pairs} == {(i + 1, k + 1)
                                                          for i, (k, _, _) in named.items()}
    again = CleanReport.from_dict(d).to_dict()
    assert {**again, "docs_per_second": None} == {**d, "docs_per_second": None}
    example = step.examples[0]
    assert example["kept_text"] == corpus[example["kept_row"] - 1][:300] + "…"
    html = report.pairs_html()
    assert f"near-duplicate of row {example['kept_row']}" in html
    assert "village library" in html  # the kept side is shown, not only the removed one
    # What differs is marked: a word only the removed document has is inside a <del>.
    removed_words = set(example["text"].split()) - set(example["kept_text"].split())
    marked_words = " ".join(re.findall(r"<del [^>]*>(.*?)</del>", html))
    assert removed_words and any(w in marked_words for w in removed_words)
    assert "Jaccard with the kept document" in report.summary()


def test_raising_the_threshold_never_removes_more() -> None:
    # Originals sharing at most one paragraph, each followed later by one edited copy, so the
    # decision on a copy depends only on its own original (no chains of copies).
    triples = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8),
               (9, 0, 5), (9, 1, 8)]
    assert all(len(set(a) & set(b)) <= 1 for a in triples for b in triples if a != b)
    for seed in range(4):
        rng = random.Random(seed)
        docs = [doc(*t) for t in triples]
        docs += [with_edits(doc(*t), rng.randint(1, 16), offset=rng.randrange(14))
                 for t in triples]
        low, high = sorted(rng.uniform(0.55, 0.95) for _ in range(2))
        # The same bands for both, so the candidates are the same and only the check differs.
        removed_low, _ = run(docs, threshold=low, bands=28)
        removed_high, _ = run(docs, threshold=high, bands=28)
        assert removed_high <= removed_low, (seed, low, high)
        # And the default banding (chosen from each threshold) keeps the same order here.
        assert run(docs, threshold=high)[0] <= run(docs, threshold=low)[0], (seed, low, high)


@pytest.mark.parametrize("options, message", [
    ({"threshold": 0}, "threshold must be between 0 and 1"),
    ({"threshold": "high"}, "threshold must be between 0 and 1"),
    ({"sketch_size": 8}, "sketch_size must be between 16 and 65536"),
    ({"bands": 0}, "bands must be between 1 and num_perm"),
])
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(SpecError, match=rf"data\.clean\.options\.near_dedup: {message}"):
        build_steps(["near_dedup"], {"near_dedup": options})


def test_index_finds_every_kept_document_after_growing() -> None:
    import numpy as np

    from workbench.data.clean.near_index import NearDupIndex

    rng = random.Random(0)
    index = NearDupIndex(threshold=0.9, sketch_size=16, capacity=16)
    docs = []
    for row in range(1, 3001):
        # Random band keys plus one key shared by a hundred documents (a busy bucket), and a
        # sketch that no other document has.
        key = ([rng.getrandbits(64) for _ in range(6)] + [row // 100 + 1],
               np.array([3 * row, 3 * row + 1], dtype=np.uint32), True)
        assert index.check(key, row) is None
        docs.append(key)
    for row, (bands, sketch, whole) in enumerate(docs, start=1):
        match = index.best_match((bands[:6], sketch, whole))
        assert match is not None and (match.kept_row, match.similarity) == (row, 1.0)
    assert len(index) == 3000


def test_index_similarity_is_the_set_jaccard_exact_or_close() -> None:
    import numpy as np

    from workbench.data.clean.near_index import NearDupIndex

    rng = random.Random(5)
    for size, k in ((60, 256), (3000, 256)):  # whole sets (exact), then bottom-k sketches
        base = set(rng.sample(range(1, 2**32), size))
        index = NearDupIndex(threshold=0.01, sketch_size=k)
        others = []
        for row in range(1, 6):  # kept documents overlapping the base set more and more
            keep = set(rng.sample(sorted(base), size * row // 6))
            other = keep | set(rng.sample(range(1, 2**32), size - len(keep)))
            others.append(other)
            arr = np.array(sorted(other), dtype=np.uint32)
            index.add(([row], arr[:k], arr.size <= k), row)
        arr = np.array(sorted(base), dtype=np.uint32)
        match = index.best_match((list(range(1, 6)), arr[:k], arr.size <= k))
        true = [len(base & o) / len(base | o) for o in others]
        assert match is not None and match.kept_row == 5
        if size <= k:
            assert (match.method, match.similarity) == ("exact", true[4])
        else:
            assert match.method == "estimated" and abs(match.similarity - true[4]) < 0.1
