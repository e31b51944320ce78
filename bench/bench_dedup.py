"""Benchmark of near-duplicate removal on a corpus with shared paragraphs and templates.

The corpus is made here, from its own made-up vocabulary (nothing from the filter's code or word
lists): documents of three paragraphs (~1 KB) drawn from a shared pool with skewed popularity,
so many pairs share one paragraph and some share two; some paragraphs are fill-in templates;
and planted near-duplicates copy an earlier document with 1-10 word edits (and sometimes their
paragraphs reordered), so their similarity spans the threshold. Ground truth is exact: the
word 5-gram Jaccard similarity of every document with every earlier one (counted through an
inverted index of 5-grams, so every pair sharing at least one 5-gram is counted exactly and the
others are 0). A document is a true near-duplicate when its best earlier match is >= the
threshold.

Side by side in one process, alternating which goes first: workbench's ``near_dedup`` (its key
+ index, as the pipeline runs it, and the whole pipeline with only that step) and datasketch's
MinHash + MinHashLSH on the same shingles (as usually used: an LSH hit removes the document; and
with each candidate verified by datasketch's own Jaccard estimate). datasketch (and scipy) are
installed by this script into a cache folder when missing. The banding-only decision that
``near_dedup`` made before verification (14 bands x 8 rows) is scored too. Writes
bench/results/dedup.json.

    python bench/bench_dedup.py [--docs 4000] [--threshold 0.75] [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from workbench.data.clean import CleanPipeline  # noqa: E402
from workbench.data.clean.dedup import MinHasher, NearDedup, U64Set  # noqa: E402
from workbench.data.clean.step import Doc  # noqa: E402

SHINGLE = 5
_WORD = re.compile(r"\w+")
_SYLLABLES = ["ka", "ro", "mi", "tu", "sen", "dal", "vo", "ri", "pe", "lan", "mo", "shi", "ga",
              "ne", "qua", "bel", "tor", "fi", "zu", "ha", "li", "do", "wen", "ca", "ver", "so",
              "nu", "plo", "gre", "ast", "im", "el", "or", "un"]


# ---- the corpus ---------------------------------------------------------------------------------

class Corpus:
    """Documents plus how each was made (``kinds``: "fresh" or "planted")."""

    def __init__(self, n_docs: int, seed: int = 0, pool: int = 1500, planted: float = 0.035
                 ) -> None:
        rng = self.rng = random.Random(seed)
        vocab: list[str] = []
        seen: set[str] = set()
        while len(vocab) < 4000:
            w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3))))
            if w not in seen:
                seen.add(w)
                vocab.append(w)
        self.vocab = vocab
        # Zipf-like word frequencies, like real text: common words make chance 5-gram overlaps.
        self.weights = [1.0 / (r + 1) for r in range(len(vocab))]
        self.pool = [self.paragraph() for _ in range(pool)]
        self.pool_weights = [1.0 / (r + 1) ** 0.6 for r in range(pool)]  # some are very common
        self.templates = [self.paragraph() for _ in range(15)]
        self.docs: list[str] = []
        self.kinds: list[str] = []
        fresh: list[list[list[str]]] = []
        for _ in range(n_docs):
            if fresh and rng.random() < planted:
                paragraphs = self.edit(rng.choice(fresh))
                self.kinds.append("planted")
            else:
                paragraphs = [self.template() if rng.random() < 0.15 else
                              list(rng.choices(self.pool, self.pool_weights)[0])
                              for _ in range(3)]
                fresh.append(paragraphs)
                self.kinds.append("fresh")
            self.docs.append("\n\n".join(self.render(p) for p in paragraphs))

    def words(self, n: int) -> list[str]:
        return self.rng.choices(self.vocab, self.weights, k=n)

    def paragraph(self) -> list[str]:
        return self.words(self.rng.randint(45, 60))

    def template(self) -> list[str]:
        """A template paragraph with three slots filled in."""
        words = list(self.rng.choice(self.templates))
        for i in self.rng.sample(range(len(words)), 3):
            words[i] = self.words(1)[0]
        return words

    def edit(self, paragraphs: list[list[str]]) -> list[list[str]]:
        """A near copy: 1-10 words substituted, inserted or deleted; sometimes reordered."""
        rng = self.rng
        out = [list(p) for p in paragraphs]
        for _ in range(rng.randint(1, 10)):
            p = rng.choice(out)
            i = rng.randrange(len(p))
            op = rng.random()
            if op < 0.6:
                p[i] = self.words(1)[0]
            elif op < 0.8:
                p.insert(i, self.words(1)[0])
            elif len(p) > 10:
                del p[i]
        if rng.random() < 0.2:
            rng.shuffle(out)
        return out

    @staticmethod
    def render(words: list[str]) -> str:
        sentences, i = [], 0
        while i < len(words):
            n = 7 + (i * 7919 + len(words)) % 9
            sentences.append(" ".join(words[i:i + n]).capitalize() + ".")
            i += n
        return " ".join(sentences)


def shingles(text: str) -> set[tuple[str, ...]]:
    """Word 5-grams of the lowercased text: for this ASCII corpus, the same words (runs of
    letters/digits) and shingles as the filter's."""
    ws = _WORD.findall(text.lower())
    if len(ws) < SHINGLE:
        return {tuple(ws)}
    return {tuple(ws[i:i + SHINGLE]) for i in range(len(ws) - SHINGLE + 1)}


def exact_best_earlier(sets: list[set[tuple[str, ...]]]) -> list[tuple[float, int]]:
    """For each document, (best exact Jaccard with an earlier document, that document) by
    counting shared 5-grams with every earlier document through an inverted index."""
    postings: dict[tuple[str, ...], list[int]] = {}
    out: list[tuple[float, int]] = []
    for i, s in enumerate(sets):
        shared: Counter[int] = Counter()
        for g in s:
            docs = postings.get(g)
            if docs:
                shared.update(docs)
        best, arg = 0.0, -1
        for j, inter in shared.items():
            sim = inter / (len(s) + len(sets[j]) - inter)
            if sim > best:
                best, arg = sim, j
        out.append((best, arg))
        for g in s:
            postings.setdefault(g, []).append(i)
    return out


# ---- the contenders -----------------------------------------------------------------------------

def run_workbench(docs: list[str], threshold: float) -> dict:
    step = NearDedup(threshold=threshold)
    index = step.new_index()
    step.key(Doc({"text": docs[0]}))  # build the hasher's tables outside the timing
    removed: dict[int, tuple[int, float, str]] = {}
    t, c = time.perf_counter(), time.process_time()
    for row, text in enumerate(docs, start=1):
        match = index.check(step.key(Doc({"text": text})), row)
        if match is not None:
            removed[row - 1] = (match.kept_row - 1, match.similarity, match.method)
    return {"removed": removed, "wall_s": time.perf_counter() - t,
            "cpu_s": time.process_time() - c, "bands": step.bands, "rows": step.rows,
            "candidates_verified": index.verified, "candidates_rejected": index.rejected,
            "index_bytes_per_kept_doc": round(index.nbytes / max(len(index), 1))}


def run_banding_only(docs: list[str]) -> dict:
    """near_dedup as it was before issue 23: a shared LSH band (14 x 8) removes a document."""
    hasher, index = MinHasher(112, 14, SHINGLE), U64Set()
    removed: dict[int, tuple[int, float, str]] = {}
    t, c = time.perf_counter(), time.process_time()
    for i, text in enumerate(docs):
        if index.seen(hasher.keys(text)):
            removed[i] = (-1, float("nan"), "none")
    return {"removed": removed, "wall_s": time.perf_counter() - t,
            "cpu_s": time.process_time() - c, "bands": 14, "rows": 8}


def run_workbench_pipeline(docs: list[str], threshold: float) -> dict:
    pipeline = CleanPipeline.from_names(["near_dedup"], {"near_dedup": {"threshold": threshold}},
                                        workers=1, progress=False)
    t, c = time.perf_counter(), time.process_time()
    rows, report = pipeline.run({"text": d} for d in docs)
    kept = sum(1 for _ in rows)
    return {"kept": kept, "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "removed": {r - 1: (k - 1, sim, m) for r, k, sim, m in
                        report.step("near_dedup").duplicates}}


def ensure_datasketch() -> str:
    """Import datasketch, installing it (and scipy, which its LSH needs) with pip into a cache
    folder first when it is missing; returns its version."""
    try:
        import datasketch
    except ImportError:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
            "workbench-bench-deps")
        if not (cache / "datasketch").is_dir():
            need = ["datasketch"]
            try:
                import scipy  # noqa: F401
            except ImportError:
                need.append("scipy")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", str(cache), *need], check=True)
        sys.path.append(str(cache))  # after the environment's own packages (numpy stays ours)
        import datasketch
    return str(getattr(datasketch, "__version__", "?"))


def run_datasketch(docs: list[str], threshold: float, verify: bool) -> dict:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=112)
    kept: dict[int, MinHash] = {}
    removed: dict[int, tuple[int, float, str]] = {}
    t, c = time.perf_counter(), time.process_time()
    for i, text in enumerate(docs):
        m = MinHash(num_perm=112)
        m.update_batch([" ".join(g).encode() for g in shingles(text)])
        hits = lsh.query(m)
        if verify:
            sims = [(m.jaccard(kept[h]), h) for h in hits]
            sims = [(s, h) for s, h in sims if s >= threshold]
            hit = max(sims, default=None)
        else:
            hit = (float("nan"), hits[0]) if hits else None
        if hit is not None:
            removed[i] = (hit[1], hit[0], "estimated")
        else:
            lsh.insert(i, m)
            kept[i] = m
    return {"removed": removed, "wall_s": time.perf_counter() - t,
            "cpu_s": time.process_time() - c, "bands": lsh.b, "rows": lsh.r}


# ---- scoring ------------------------------------------------------------------------------------

def score(removed: dict[int, tuple[int, float, str]], truth: list[tuple[float, int]],
          sets: list[set], threshold: float) -> dict:
    true = {i for i, (sim, _) in enumerate(truth) if sim >= threshold}
    hit = true & set(removed)
    false = sorted(set(removed) - true)
    errors = []
    for i, (k, sim, _) in removed.items():
        if sim == sim:  # not NaN: compare the reported similarity with the exact one
            inter = len(sets[i] & sets[k])
            errors.append(abs(sim - inter / (len(sets[i]) + len(sets[k]) - inter)))
    return {"removed": len(removed), "true_positives": len(hit), "false_positives": len(false),
            "false_positives_below_0.5": sum(truth[i][0] < 0.5 for i in false),
            "missed": len(true - hit),
            "precision": round(len(hit) / len(removed), 4) if removed else 1.0,
            "recall": round(len(hit) / len(true), 4) if true else 1.0,
            "max_similarity_error": round(max(errors), 4) if errors else None,
            "methods": dict(Counter(m for _, _, m in removed.values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--threshold", type=float, default=0.75)
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each contender")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dedup.json")
    args = ap.parse_args()
    t = args.threshold
    corpus = Corpus(args.docs, args.seed)
    docs = corpus.docs
    sets = [shingles(d) for d in docs]
    t0 = time.perf_counter()
    truth = exact_best_earlier(sets)
    truth_s = time.perf_counter() - t0
    sims = [s for s, _ in truth]
    version = ensure_datasketch()

    contenders: dict[str, Callable[[], dict]] = {
        "workbench": lambda: run_workbench(docs, t),
        "workbench_pipeline": lambda: run_workbench_pipeline(docs, t),
        "banding_only_before": lambda: run_banding_only(docs),
        "datasketch": lambda: run_datasketch(docs, t, verify=False),
        "datasketch_verified": lambda: run_datasketch(docs, t, verify=True),
    }
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate who goes first
            runs[name].append(contenders[name]())
    results = {}
    for name, rs in runs.items():
        n = len(docs)
        walls = [n / x["wall_s"] for x in rs]
        cpus = [n / x["cpu_s"] for x in rs]
        first = rs[0]
        results[name] = {
            **score(first["removed"], truth, sets, t),
            "docs_per_s_per_core": round(statistics.median(walls)),
            "docs_per_s_per_core_best": round(max(walls)),
            "docs_per_cpu_s": round(statistics.median(cpus)),
            **{k: v for k, v in first.items() if k in ("bands", "rows", "candidates_verified",
                                                       "candidates_rejected",
                                                       "index_bytes_per_kept_doc")},
            "same_decisions_every_round": all(x["removed"].keys() == first["removed"].keys()
                                              for x in rs)}
    out = {
        "corpus": {"docs": len(docs), "mean_chars": round(statistics.mean(map(len, docs))),
                   "planted": corpus.kinds.count("planted"),
                   "true_near_duplicates": sum(s >= t for s in sims),
                   "docs_with_best_earlier_jaccard": {
                       f"{lo:.1f}-{lo + 0.1:.1f}": sum(lo <= s < lo + 0.1 for s in sims)
                       for lo in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)},
                   "ground_truth_s": round(truth_s, 1)},
        "threshold": t, "rounds": args.rounds, "datasketch_version": version,
        "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "results": results,
        "ratio_workbench_vs_datasketch_docs_per_s": round(
            results["workbench"]["docs_per_s_per_core"]
            / results["datasketch"]["docs_per_s_per_core"], 2),
    }
    path = args.out
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    c = out["corpus"]
    print(f"{c['docs']} docs, mean {c['mean_chars']} chars, {c['true_near_duplicates']} true "
          f"near-duplicates at Jaccard >= {t} ({c['planted']} planted); best-earlier Jaccard "
          f"histogram {c['docs_with_best_earlier_jaccard']}")
    for name, r in results.items():
        print(f"{name:<20} precision {r['precision']:.3f} recall {r['recall']:.3f} "
              f"removed {r['removed']} (false {r['false_positives']}, missed {r['missed']}) "
              f"{r['docs_per_s_per_core']} docs/s/core ({r['docs_per_cpu_s']} per CPU s)")
    print(f"targets: precision >= 0.98, recall >= 0.95, >= 2000 docs/s/core -> {path}")


if __name__ == "__main__":
    main()
