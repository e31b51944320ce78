"""Benchmark of the data-cleaning pipeline: documents/s per core and dedup quality.

Measures, on generated ~2 KB documents: MinHash signature + LSH insert alone (one process),
the default pipeline (one process, so per core), and dedup precision/recall on a corpus with
planted duplicates; with ``--big`` also a ~1 GB corpus through the streaming pipeline (what
``clean_file`` does) on every core with peak memory (parent + workers). A plain datasketch loop
is timed side by side on the same documents, alternating order, when datasketch is installed
(bench/bench_dedup.py installs it and compares dedup quality too). Writes bench/results/data.json, and the big
run to bench/results/data-big.json (rewritten every 10 s while it runs, with ``"finished":
false`` and the documents done so far, so an interrupted run still says how far it got).

Per-core rates are given twice: per wall-clock second (``docs_per_s_per_core``) and per second
of CPU time of the process (``docs_per_cpu_s``); on a machine shared with other jobs the second
is the steadier one.

    python bench/bench_data.py --quick
    python bench/bench_data.py --big 1000000000 [--corpus /tmp/big.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from workbench.data.clean import (  # noqa: E402
    CleanPipeline,
    clean_records,
    read_records,
    write_records,
)
from workbench.data.clean.corpus import generate_records, write_corpus  # noqa: E402
from workbench.data.clean.dedup import MinHasher, U64Set  # noqa: E402


def docs_2kb(n: int, seed: int = 0) -> list[str]:
    rows = generate_records(n, seed, doc_chars=(1800, 2200), exact_dup_fraction=0,
                            near_dup_fraction=0, junk_fraction=0, toxic_fraction=0,
                            other_lang_fraction=0, pii_fraction=0)
    return [r["text"] for r in rows]


def _ours(texts: list[str]) -> tuple[float, float]:
    mh, index = MinHasher(), U64Set()
    t, c = time.perf_counter(), time.process_time()
    for text in texts:
        index.seen(mh.keys(text))
    return time.perf_counter() - t, time.process_time() - c


def _datasketch(texts: list[str]) -> tuple[float, float]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=112, params=(14, 8))  # the same bands x rows as near_dedup
    t, c = time.perf_counter(), time.process_time()
    for i, text in enumerate(texts):
        ws = text.split()
        m = MinHash(num_perm=112)
        m.update_batch([" ".join(ws[j:j + 5]).encode() for j in range(max(1, len(ws) - 4))])
        if not lsh.query(m):
            lsh.insert(str(i), m)
    return time.perf_counter() - t, time.process_time() - c


def bench_minhash(texts: list[str]) -> dict:
    """Ours and datasketch on the same documents in one process, alternating which goes first
    (ours, datasketch, datasketch, ours), best of each. For dedup quality as well as speed,
    side by side on a corpus with a known answer, see bench/bench_dedup.py."""
    MinHasher().keys(texts[0])  # warm-up: tables built, code paths compiled
    try:
        import datasketch  # noqa: F401
    except ImportError:
        wall, cpu = _ours(texts)
        return {"docs": len(texts), "docs_per_s_per_core": round(len(texts) / wall),
                "docs_per_cpu_s": round(len(texts) / cpu),
                "datasketch": "not installed (bench/bench_dedup.py installs it)"}
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "datasketch": []}
    for name in ("ours", "datasketch", "datasketch", "ours"):
        times[name].append((_ours if name == "ours" else _datasketch)(texts))
    ours, ds = min(times["ours"]), min(times["datasketch"])
    return {"docs": len(texts), "docs_per_s_per_core": round(len(texts) / ours[0]),
            "docs_per_cpu_s": round(len(texts) / ours[1]),
            "datasketch_docs_per_s": round(len(texts) / ds[0]),
            "datasketch_docs_per_cpu_s": round(len(texts) / ds[1]),
            "ratio_vs_datasketch": round(ds[0] / ours[0], 2)}


def bench_pipeline(n: int) -> dict:
    rows = list(generate_records(n, seed=11, doc_chars=(1800, 2200)))
    clean_records(rows[:20], workers=1, progress=False)  # load the language model etc. first
    t, c = time.perf_counter(), time.process_time()
    kept, report = clean_records(rows, workers=1, progress=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    planted = {r["id"] for r in rows if r["kind"] in ("exact_dup", "near_dup")}
    kept_ids = {r["id"] for r in kept}
    removed_dup = report.step("exact_dedup").removed + report.step("near_dedup").removed
    caught = len(planted - kept_ids)
    return {"docs": n, "docs_per_s_per_core": round(n / dt), "docs_per_cpu_s": round(n / cpu),
            "dedup_precision": round(caught / max(removed_dup, 1), 4),
            "dedup_recall": round(caught / max(len(planted), 1), 4),
            "planted_duplicates": len(planted)}


def bench_big(size: int, workers: int, corpus: Path | None, out_json: Path) -> dict:
    """Clean a ~``size``-byte generated corpus on ``workers`` processes, sampling the peak RSS
    of the parent and its workers; ``out_json`` is rewritten every 10 s while it runs."""
    import psutil


    with tempfile.TemporaryDirectory() as tmp:
        src = corpus or Path(tmp) / "big.jsonl"
        info_path = src.with_name(src.name + ".info.json")
        if corpus is not None and info_path.is_file():  # made earlier by this function
            info = json.loads(info_path.read_text())
        else:
            t = time.perf_counter()
            info = write_corpus(src, target_bytes=size, seed=3, doc_chars=(1800, 2200))
            info["generate_s"] = round(time.perf_counter() - t, 1)
            if corpus is not None:
                info_path.write_text(json.dumps(info))
        me = psutil.Process()
        peak = [0]
        done = threading.Event()
        result: dict = {"bytes": info["bytes"], "docs": info["documents"],
                        "generate_s": info.get("generate_s"), "workers": workers,
                        "finished": False}
        pipeline = CleanPipeline.from_names(None, workers=workers, progress=True)
        rows, report = pipeline.run(read_records(src, ["text"]), ["text"], source=str(src))
        t = time.perf_counter()

        def snapshot() -> None:
            dt = time.perf_counter() - t
            result.update(elapsed_s=round(dt, 1), docs_done=report.documents_in,
                          docs_per_s=round(report.documents_in / max(dt, 1e-9)),
                          docs_per_s_per_core=round(report.documents_in / max(dt, 1e-9) / workers),
                          peak_rss_mb_parent_plus_workers=round(peak[0] / 2**20))
            out_json.write_text(json.dumps(result, indent=2) + "\n")

        def sample() -> None:
            last = time.perf_counter()
            while not done.is_set():
                try:
                    rss = me.memory_info().rss + sum(
                        c.memory_info().rss for c in me.children(recursive=True))
                except psutil.Error:
                    continue
                peak[0] = max(peak[0], rss)
                if time.perf_counter() - last >= 10:
                    snapshot()
                    last = time.perf_counter()
                time.sleep(0.2)

        threading.Thread(target=sample, daemon=True).start()
        write_records(Path(tmp) / "out.jsonl", rows)  # what clean_file does, minus the rename
        done.set()
        snapshot()
    result.update(finished=True, kept=report.documents_out, clean_s=result["elapsed_s"])
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small run (seconds)")
    ap.add_argument("--big", type=int, default=0, metavar="BYTES",
                    help="also clean a generated corpus of this size (e.g. 1000000000)")
    ap.add_argument("--corpus", type=Path, default=None, metavar="PATH",
                    help="with --big: generate the corpus here once and reuse it on later runs "
                         "(default: a temporary file)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    n = 500 if args.quick else 4000
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    result = {"minhash": bench_minhash(docs_2kb(n)),
              "pipeline": bench_pipeline(n // 2 if args.quick else 2000)}
    if args.big:
        result["big"] = bench_big(args.big, args.workers, args.corpus, results / "data-big.json")
    out = results / "data.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    m, p = result["minhash"], result["pipeline"]
    print(f"MinHash+LSH: {m['docs_per_s_per_core']} docs/s/core on 2 KB docs (target >= 2000)"
          + (f", {m['ratio_vs_datasketch']}x datasketch" if "ratio_vs_datasketch" in m else ""))
    print(f"default pipeline: {p['docs_per_s_per_core']} docs/s/core "
          f"({p['docs_per_cpu_s']} per CPU second); dedup precision "
          f"{p['dedup_precision']}, recall {p['dedup_recall']}")
    if "big" in result:
        b = result["big"]
        print(f"{b['bytes'] / 1e9:.2f} GB: {b['docs_per_s']} docs/s on {b['workers']} workers, "
              f"peak RSS {b['peak_rss_mb_parent_plus_workers']} MB")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
