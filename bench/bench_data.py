"""Benchmark of the data-cleaning pipeline: documents/s per core and dedup quality.

Measures, on generated ~2 KB documents: MinHash signature + LSH insert alone (one process),
the default pipeline (one process, so per core), and dedup precision/recall on a corpus with
planted duplicates; with ``--big`` also a ~1 GB corpus through ``clean_file`` on every core with
peak memory (parent + workers). A plain datasketch loop is timed side by side when datasketch
is installed. Writes bench/results/data.json.

    python bench/bench_data.py --quick
    python bench/bench_data.py --big 1000000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.data.clean import clean_file, clean_records  # noqa: E402
from workbench.data.clean.corpus import generate_records, write_corpus  # noqa: E402
from workbench.data.clean.dedup import MinHasher, U64Set  # noqa: E402


def docs_2kb(n: int, seed: int = 0) -> list[str]:
    rows = generate_records(n, seed, doc_chars=(1800, 2200), exact_dup_fraction=0,
                            near_dup_fraction=0, junk_fraction=0, toxic_fraction=0,
                            other_lang_fraction=0, pii_fraction=0)
    return [r["text"] for r in rows]


def bench_minhash(texts: list[str]) -> dict:
    mh, index = MinHasher(), U64Set()
    mh.keys(texts[0])
    t = time.perf_counter()
    for text in texts:
        index.seen(mh.keys(text))
    ours = len(texts) / (time.perf_counter() - t)
    out = {"docs": len(texts), "docs_per_s_per_core": round(ours)}
    try:
        from datasketch import MinHash, MinHashLSH
    except ImportError:
        out["datasketch"] = "not installed"
        return out
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    sample = texts[: max(200, len(texts) // 5)]
    t = time.perf_counter()
    for i, text in enumerate(sample):
        ws = text.split()
        m = MinHash(num_perm=112)
        m.update_batch([" ".join(ws[j:j + 5]).encode() for j in range(max(1, len(ws) - 4))])
        if not lsh.query(m):
            lsh.insert(str(i), m)
    ds = len(sample) / (time.perf_counter() - t)
    out.update(datasketch_docs_per_s=round(ds), ratio_vs_datasketch=round(ours / ds, 2))
    return out


def bench_pipeline(n: int) -> dict:
    rows = list(generate_records(n, seed=11, doc_chars=(1800, 2200)))
    t = time.perf_counter()
    kept, report = clean_records(rows, workers=1, progress=False)
    dt = time.perf_counter() - t
    planted = {r["id"] for r in rows if r["kind"] in ("exact_dup", "near_dup")}
    kept_ids = {r["id"] for r in kept}
    removed_dup = report.step("exact_dedup").removed + report.step("near_dedup").removed
    caught = len(planted - kept_ids)
    return {"docs": n, "docs_per_s_per_core": round(n / dt),
            "dedup_precision": round(caught / max(removed_dup, 1), 4),
            "dedup_recall": round(caught / max(len(planted), 1), 4),
            "planted_duplicates": len(planted)}


def bench_big(size: int, workers: int) -> dict:
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "big.jsonl"
        t = time.perf_counter()
        info = write_corpus(src, target_bytes=size, seed=3, doc_chars=(1800, 2200))
        gen_s = time.perf_counter() - t
        me = psutil.Process()
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                try:
                    rss = me.memory_info().rss + sum(
                        c.memory_info().rss for c in me.children(recursive=True))
                except psutil.Error:
                    continue
                peak[0] = max(peak[0], rss)
                time.sleep(0.2)

        threading.Thread(target=sample, daemon=True).start()
        t = time.perf_counter()
        report = clean_file(src, Path(tmp) / "out.jsonl", workers=workers, progress=True)
        dt = time.perf_counter() - t
        done.set()
    return {"bytes": info["bytes"], "docs": info["documents"], "generate_s": round(gen_s, 1),
            "clean_s": round(dt, 1), "workers": workers,
            "docs_per_s": round(info["documents"] / dt),
            "docs_per_s_per_core": round(info["documents"] / dt / workers),
            "peak_rss_mb_parent_plus_workers": round(peak[0] / 2**20),
            "kept": report.documents_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small run (seconds)")
    ap.add_argument("--big", type=int, default=0, metavar="BYTES",
                    help="also clean a generated corpus of this size (e.g. 1000000000)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    n = 500 if args.quick else 4000
    result = {"minhash": bench_minhash(docs_2kb(n)),
              "pipeline": bench_pipeline(n // 2 if args.quick else 2000)}
    if args.big:
        result["big"] = bench_big(args.big, args.workers)
    out = Path(__file__).parent / "results" / "data.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    m, p = result["minhash"], result["pipeline"]
    print(f"MinHash+LSH: {m['docs_per_s_per_core']} docs/s/core on 2 KB docs (target >= 2000)"
          + (f", {m['ratio_vs_datasketch']}x datasketch" if "ratio_vs_datasketch" in m else ""))
    print(f"default pipeline: {p['docs_per_s_per_core']} docs/s/core; dedup precision "
          f"{p['dedup_precision']}, recall {p['dedup_recall']}")
    if "big" in result:
        b = result["big"]
        print(f"{b['bytes'] / 1e9:.2f} GB: {b['docs_per_s']} docs/s on {b['workers']} workers, "
              f"peak RSS {b['peak_rss_mb_parent_plus_workers']} MB")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
