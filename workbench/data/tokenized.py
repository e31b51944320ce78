"""Tokenise a run's prepared data once, at launch: the run's Arrow files, statistics, a verdict.

The launching process tokenises ``RUN_DIR/data/{train,validation}.jsonl`` with the model's own
tokenizer and chat template (:mod:`workbench.data.token_table`), writes
``RUN_DIR/data/tokenized/SPLIT`` (``datasets`` Arrow, which every rank memory-maps with
``load_from_disk``) and ``RUN_DIR/data/stats.json``, and refuses the launch
(:class:`~workbench.errors.DataTruncationError`) when truncation leaves nothing, or too much,
untrainable. The result is cached (:mod:`workbench.data.token_cache`), so a later run on the same
data links the cached files instead of tokenising again, without loading the tokenizer where the
files alone name the entry (:func:`reuse_tokenized`); resumes, requeues and restarts read the
run's own copy.

    >>> stats = prepare_tokenized(spec, run_dir, tokenizer)  # doctest: +SKIP
    >>> stats.splits["train"].dropped, stats.trainable_tokens_per_epoch
    (0, 4180)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from workbench.data.stats import TokenStats
from workbench.data.token_cache import (
    SPLITS,
    cache_root,
    cached_stats,
    files_key,
    fingerprint,
    link_tree,
    remember,
    store,
)
from workbench.data.token_table import Progress, empty_table, tokenize_split
from workbench.errors import DataTruncationError
from workbench.spec import RunSpec
from workbench.train.quiet import no_progress_bars

# With the names of workbench.data.token_cache and .token_table that callers import from here.
__all__ = ["cached_stats", "check_trainable", "eval_sample", "files_key", "load_tokenized",
           "prepare_tokenized", "reuse_tokenized", "token_stats", "tokenize_split",
           "truncation_notice"]


def reuse_tokenized(spec: RunSpec, run_dir: Any, key: str | None) -> TokenStats | None:
    """Link the cache entry that :func:`files_key` ``key`` names into the run, as
    :func:`prepare_tokenized` does on a hit, without a tokenizer; None when there is none."""
    stats = cached_stats(key)
    if stats is None or stats.fingerprint is None:
        return None
    started = time.time()
    run_dir.write_status(phase="preparing", prepare={"split": "train", "done": 0})
    return _link_hit(run_dir, stats.fingerprint, started)


def _link_hit(run_dir: Any, fp: str, started: float) -> TokenStats:
    out = run_dir.data_dir / "tokenized"
    link_tree(cache_root() / fp, out)
    stats = TokenStats.from_dict(json.loads((out / "stats.json").read_text(encoding="utf-8")))
    return _finish(run_dir, stats, fp, True, started)


def _finish(run_dir: Any, stats: TokenStats, fp: str, hit: bool, started: float) -> TokenStats:
    (run_dir.data_dir / "stats.json").write_text(json.dumps(stats.to_dict(), indent=1),
                                                 encoding="utf-8")
    run_dir.write_status(phase=None, prepare={
        "fingerprint": fp, "cache_hit": hit, "seconds": round(time.time() - started, 3),
        "path": str(run_dir.data_dir / "tokenized")})
    return stats


def prepare_tokenized(spec: RunSpec, run_dir: Any, tokenizer: Any,
                      progress: Progress | None = None, key: str | None = None) -> TokenStats:
    """Tokenise (or reuse the cache for) a run's prepared data; write tokenized/ and stats.json.

    ``run_dir`` is a RunDir; while this works its status.json says ``phase: preparing`` with
    how far it got, so the job view and ``workbench status`` show it. ``key`` (from
    :func:`files_key`, before the data was prepared) is remembered as naming this entry.
    """
    data_dir: Path = run_dir.data_dir
    started = time.time()
    fp = fingerprint(spec, data_dir, tokenizer)
    cached = cache_root() / fp
    out = data_dir / "tokenized"
    last = [0.0]

    def report(split: str, done: int, total: int) -> None:
        if progress is not None:
            progress(split, done, total)
        if time.time() - last[0] > 0.5 or done == total:
            last[0] = time.time()
            run_dir.write_status(phase="preparing",
                                 prepare={"split": split, "done": done, "total": total})

    run_dir.write_status(phase="preparing", prepare={"split": "train", "done": 0})
    if (cached / "stats.json").is_file():
        stats = _link_hit(run_dir, fp, started)
        remember(key, fp)
        return stats
    import datasets  # ~1 s to import: only when writing (a cache hit only links files)

    splits = {}
    for split in SPLITS:
        table, split_stats = tokenize_split(data_dir / f"{split}.jsonl", spec, tokenizer,
                                            report, split)
        with no_progress_bars():  # a second's work: no bar above the notebook's widgets
            datasets.Dataset(table).save_to_disk(str(out / split))
        splits[split] = split_stats
    stats = TokenStats(splits=splits, max_length=spec.data.max_length,
                       truncation=spec.data.truncation, packing=spec.data.packing,
                       fingerprint=fp)
    (out / "stats.json").write_text(json.dumps(stats.to_dict(), indent=1), encoding="utf-8")
    store(out, cached)
    if (cached / "stats.json").is_file():
        remember(key, fp)
    return _finish(run_dir, stats, fp, False, started)


def check_trainable(stats: TokenStats, spec: RunSpec) -> None:
    """Refuse data that truncation would (mostly) untrain, saying how many and what to do."""
    train = stats.splits["train"]
    share = train.dropped / train.examples if train.examples else 0.0
    limit = spec.data.max_dropped_fraction
    if train.kept and share <= limit:
        return
    why = ("no training example has a response token left" if not train.kept else
           f"{share:.1%} of training examples would be lost, above "
           f"data.max_dropped_fraction = {limit:g}")
    raise DataTruncationError(
        f"{why} after truncation to data.max_length = {spec.data.max_length} tokens "
        f"(data.truncation: {spec.data.truncation}): {train.truncated} of {train.examples} "
        f"training examples are truncated and {train.dropped} lose every response token "
        f"(longest example: {train.tokens.get('max')} tokens, p95 {train.tokens.get('p95')}). "
        "Raise data.max_length, use data.truncation: keep_response, shorten the prompts, or "
        "raise data.max_dropped_fraction to train on the rest"
    )


# Truncation worth a word at launch: more than this many training examples, and at least this
# share of them (a few long outliers in a large set are what max_length is for).
NOTICE_MIN_EXAMPLES = 3
NOTICE_MIN_SHARE = 0.01


def truncation_notice(stats: TokenStats, spec: RunSpec) -> str | None:
    """What a launch says when truncation touches more than a few training examples: how many,
    how much of them is cut, and how to change it; None when it does not."""
    train = stats.splits["train"]
    if train.truncated <= NOTICE_MIN_EXAMPLES or train.truncated < NOTICE_MIN_SHARE * train.examples:
        return None
    lost = (f", losing {train.cut_tokens / train.truncated_tokens:.0%} of their tokens"
            if train.truncated_tokens else "")
    part = ("prompt first, data.truncation keep_response" if spec.data.truncation ==
            "keep_response" else "at the end, data.truncation right")
    longest = train.summarised().tokens.get("max")
    return (f"{train.truncated:,} of {train.examples:,} training examples are longer than "
            f"data.max_length {spec.data.max_length} and are cut ({part}){lost}; the longest "
            f"has {longest} tokens. Raise data.max_length, or shorten the data, if the model "
            "should see them whole")


def load_tokenized(data_dir: Path, split: str) -> Any:
    """The run's tokenised split, memory-mapped (None when launch wrote none for ``split``)."""
    path = data_dir / "tokenized" / split
    if not (path / "dataset_info.json").is_file():
        return None
    import datasets

    if not any(path.glob("*.arrow")):
        # An empty split (validation_fraction 0) is saved as zero shards, which load_from_disk
        # cannot read back: it is an empty dataset of the same columns.
        return datasets.Dataset(empty_table())
    return datasets.load_from_disk(str(path))


def eval_sample(rows: Any, n: int | None, seed: int) -> Any:
    """A deterministic sample of ``n`` validation rows (all of them when n is 0/None or larger)."""
    import random

    if not n or len(rows) <= n:
        return rows
    picked = sorted(random.Random(seed).sample(range(len(rows)), n))
    if hasattr(rows, "select"):
        return rows.select(picked)
    return [rows[i] for i in picked]


def token_stats(spec: RunSpec, tokenizer: Any = None, max_rows: int | None = None) -> TokenStats:
    """Token statistics for a spec's data without launching (for the planner and the form).

    ``max_rows`` reads only the first rows of each source (a quick preview). A full-data result
    comes from the cache when a run on the same data and settings has been prepared before.
    """
    import tempfile

    from workbench.data.prepare import prepare_data

    if tokenizer is None:
        from workbench.data.tokenize import load_tokenizer
        from workbench.spec.models import resolve_model

        tokenizer = load_tokenizer(spec, resolve_model(spec.model.id))
    if max_rows is not None:
        spec = spec.model_copy(deep=True)
        for source in spec.data.sources:
            source.max_rows = min(source.max_rows or max_rows, max_rows)
    with tempfile.TemporaryDirectory(prefix="workbench-stats-") as tmp:
        data_dir = Path(tmp)
        prepare_data(spec, data_dir, cache=max_rows is None)
        cached = cache_root() / fingerprint(spec, data_dir, tokenizer) / "stats.json"
        if cached.is_file():
            return TokenStats.from_dict(json.loads(cached.read_text()))
        splits = {s: tokenize_split(data_dir / f"{s}.jsonl", spec, tokenizer, split=s)[1]
                  for s in SPLITS}
    return TokenStats(splits=splits, max_length=spec.data.max_length,
                      truncation=spec.data.truncation, packing=spec.data.packing)
