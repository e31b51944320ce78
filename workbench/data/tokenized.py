"""Tokenise a run's prepared data once, at launch: Arrow files, a cache, statistics, a verdict.

The launching process tokenises ``RUN_DIR/data/{train,validation}.jsonl`` with the model's own
tokenizer and chat template, writes ``RUN_DIR/data/tokenized/SPLIT`` (``datasets`` Arrow, which
every rank memory-maps with ``load_from_disk``) and ``RUN_DIR/data/stats.json``, and refuses the
launch (:class:`~workbench.errors.DataTruncationError`) when truncation leaves nothing, or too
much, untrainable. The result is cached under ``WORKBENCH_HOME/cache/tokenized/FINGERPRINT`` (the
data files' content, tokenizer, chat template, max_length, truncation and packing), so a later
run on the same data links the cached files instead of tokenising again; resumes, requeues and
restarts read the run's own copy. The fingerprint needs the loaded tokenizer (transformers, seconds
to import); for a built-in or local model, :func:`files_key` names the same entry from files
alone (the sources' and the tokenizer files' bytes), so a repeated launch reuses the cache, and
the planner its statistics, without loading the tokenizer (:func:`reuse_tokenized`).

    >>> stats = prepare_tokenized(spec, run_dir, tokenizer)  # doctest: +SKIP
    >>> stats.splits["train"].dropped, stats.trainable_tokens_per_epoch
    (0, 4180)
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench.data.stats import SplitStats, TokenStats
from workbench.data.tokenize import (
    ChatRenderer,
    Rendered,
    encode_rendered,
    finish_batch,
    pack,
    render_batch,
)
from workbench.errors import DataTruncationError
from workbench.spec import RunSpec

SPLITS = ("train", "validation")
_VERSION = "2"  # bump when tokenisation changes, so cached results are not reused
_BATCH = 1000

Progress = Callable[[str, int, int], None]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else
             json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for part in (tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                 tokenizer.pad_token):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()


def fingerprint(spec: RunSpec, data_dir: Path, tokenizer: Any) -> str:
    h = hashlib.sha256(f"v{_VERSION}".encode())
    for split in SPLITS:
        path = data_dir / f"{split}.jsonl"
        h.update(f"\0{split}\0".encode())
        if path.is_file():
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    d = spec.data
    h.update(json.dumps([tokenizer_fingerprint(tokenizer), d.max_length, d.truncation,
                         d.packing]).encode())
    return h.hexdigest()[:24]


# Files of a model folder that hold weights, not tokenizer or config: left out of files_key.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                    ".onnx", ".npz")


def files_key(spec: RunSpec) -> str | None:
    """A key for what :func:`fingerprint` would give, from files only: the prepared data's key
    (its sources' bytes and settings), every non-weight file of the model folder (what
    AutoTokenizer reads), the tokenising settings and the versions of what turns them into
    tokens. None for a hub model, remote code or a hub dataset (the tokenizer is loaded then)."""
    from importlib.metadata import PackageNotFoundError, version

    from workbench.data.prepare import sources_key
    from workbench.data.tokenize import FALLBACK_CHAT_TEMPLATE
    from workbench.errors import WorkbenchError
    from workbench.models import resolve_model

    if spec.model.trust_remote_code:
        return None
    try:
        folder = Path(resolve_model(spec.model.id))
    except WorkbenchError:
        return None
    data_key = sources_key(spec)
    if data_key is None or not folder.is_dir():
        return None
    try:
        libs = [version("transformers"), version("tokenizers")]
    except PackageNotFoundError:
        return None
    h = hashlib.sha256(json.dumps([_VERSION, data_key, libs, FALLBACK_CHAT_TEMPLATE,
                                   spec.data.max_length, spec.data.truncation,
                                   spec.data.packing]).encode())
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            h.update(f"\0{path.name}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:24]


def _by_files(key: str) -> Path:
    return cache_root() / "by-files" / key


def cached_stats(key: str | None) -> TokenStats | None:
    """The statistics of the cache entry :func:`files_key` ``key`` names, if it is complete."""
    if key is None or not _by_files(key).is_file():
        return None
    entry = cache_root() / _by_files(key).read_text(encoding="utf-8").strip()
    if not (entry / "stats.json").is_file():
        return None
    return TokenStats.from_dict(json.loads((entry / "stats.json").read_text(encoding="utf-8")))


def _remember(key: str | None, fp: str) -> None:
    if key is None:
        return
    path = _by_files(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{key}.tmp{os.getpid()}")
    tmp.write_text(fp, encoding="utf-8")
    tmp.replace(path)  # atomic: a reader sees a whole fingerprint or none


def cache_root() -> Path:
    from workbench.home import home

    return home() / "cache" / "tokenized"


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def tokenize_split(path: Path, spec: RunSpec, tokenizer: Any,
                   progress: Progress | None = None, split: str = "train",
                   limit: int | None = None) -> tuple[Any, SplitStats]:
    """(pyarrow Table of input_ids/labels, statistics) for one prepared jsonl split."""
    stats = SplitStats()
    # Hundreds of thousands of small lists: the cyclic collector would walk them again and
    # again for nothing (a quarter of the time); none of them forms a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _tokenize_split(path, spec, tokenizer, progress, split, limit, stats)
    finally:
        if collecting:
            gc.enable()


def _chunks(fh: Any, total: int) -> Iterator[list[dict[str, Any]]]:
    """The first ``total`` non-blank rows of a jsonl file, parsed, ``_BATCH`` at a time."""
    chunk: list[dict[str, Any]] = []
    read = 0
    for line in fh:
        if read >= total:
            break
        if line.strip():
            chunk.append(json.loads(line))
            read += 1
            if len(chunk) >= _BATCH:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _tokenize_split(path: Path, spec: RunSpec, tokenizer: Any, progress: Progress | None,
                    split: str, limit: int | None, stats: SplitStats) -> tuple[Any, SplitStats]:
    import pyarrow as pa
    from tqdm.auto import tqdm

    d = spec.data
    renderer = ChatRenderer(tokenizer)
    total = _count_lines(path) if path.is_file() else 0
    if limit is not None:
        total = min(total, limit)
    kept: list[dict[str, list[int]]] = []  # packing only: rows are regrouped at the end
    # Not packing: every column is one flat list plus row offsets, turned into Arrow once.
    ids: list[int] = []
    labels: list[int] = []
    offsets = [0]
    bar = tqdm(total=total, desc=f"tokenising {split}", unit="ex", disable=total < 2 * _BATCH)
    done = 0

    def finish(rendered: Rendered, encoding: Future[Any]) -> None:
        nonlocal done
        encs = finish_batch(rendered, encoding.result(), tokenizer, d.max_length, d.truncation,
                            renderer)
        for enc in encs:
            if not stats.add(enc):
                continue
            if d.packing:
                kept.append({"input_ids": enc.input_ids, "labels": enc.labels})
            else:
                ids.extend(enc.input_ids)
                labels.extend(enc.labels)
                offsets.append(len(ids))
        done += len(rendered.examples)
        bar.update(len(rendered.examples))
        if progress is not None:
            progress(split, done, total)

    # The Rust encode of a batch releases the GIL: it runs in a thread while this one renders
    # the next batch and labels the previous one, so neither core waits on the other's part.
    # Batches are finished in order, so the result is the plain loop's, token for token. A
    # tokenizer without a Rust backend encodes in Python, holding the GIL: nothing to overlap.
    threaded = getattr(tokenizer, "backend_tokenizer", None) is not None
    pending: tuple[Rendered, Future[Any]] | None = None
    with (path.open(encoding="utf-8") if path.is_file() else open(os.devnull)) as fh, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-tokenise") as pool:
        for chunk in _chunks(fh, total):
            rendered = render_batch(chunk, tokenizer, renderer)
            if threaded:
                encoding = pool.submit(encode_rendered, tokenizer, rendered)
            else:
                encoding = Future()
                encoding.set_result(encode_rendered(tokenizer, rendered))
            if pending is not None:
                finish(*pending)
            pending = rendered, encoding
        if pending is not None:
            finish(*pending)
    bar.close()
    stats.summarised()
    if d.packing:
        return (_table(pack(kept, d.max_length)) if kept else _empty()), stats
    if len(offsets) == 1:
        return _empty(), stats
    off = pa.array(offsets, pa.int32())
    return pa.table({"input_ids": pa.ListArray.from_arrays(off, pa.array(ids, pa.int32())),
                     "labels": pa.ListArray.from_arrays(off, pa.array(labels, pa.int32()))}), stats


def _table(rows: list[dict[str, list[int]]]) -> Any:
    import numpy as np
    import pyarrow as pa

    # One flat array per column plus offsets: pa.array over a list of lists costs ~10x more.
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r["input_ids"]) for r in rows], out=offsets[1:])

    def column(key: str) -> Any:
        flat = np.fromiter((t for r in rows for t in r[key]), dtype=np.int32,
                           count=int(offsets[-1]))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))

    return pa.table({key: column(key) for key in rows[0]})


def _empty() -> Any:
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    return schema.empty_table()


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link (or copy, across filesystems) every file of ``src`` into ``dst``."""
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


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
    _link_tree(cache_root() / fp, out)
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
        _remember(key, fp)
        return stats
    import datasets  # ~1 s to import: only when writing (a cache hit only links files)

    splits = {}
    for split in SPLITS:
        table, split_stats = tokenize_split(data_dir / f"{split}.jsonl", spec, tokenizer,
                                            report, split)
        datasets.Dataset(table).save_to_disk(str(out / split))
        splits[split] = split_stats
    stats = TokenStats(splits=splits, max_length=spec.data.max_length,
                       truncation=spec.data.truncation, packing=spec.data.packing,
                       fingerprint=fp)
    (out / "stats.json").write_text(json.dumps(stats.to_dict(), indent=1), encoding="utf-8")
    _store_in_cache(out, cached)
    if (cached / "stats.json").is_file():
        _remember(key, fp)
    return _finish(run_dir, stats, fp, False, started)


def _store_in_cache(out: Path, cached: Path) -> None:
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _link_tree(out, tmp)
        tmp.rename(cached)  # atomic: a reader sees a complete entry or none
    except OSError:  # another launch stored the same fingerprint first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


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


def load_tokenized(data_dir: Path, split: str) -> Any:
    """The run's tokenised split, memory-mapped (None for run dirs made before tokenise-once)."""
    path = data_dir / "tokenized" / split
    if not (path / "dataset_info.json").is_file():
        return None
    import datasets

    if not any(path.glob("*.arrow")):
        # An empty split (validation_fraction 0) is saved as zero shards, which load_from_disk
        # cannot read back: it is an empty dataset of the same columns.
        import pyarrow as pa

        schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
        return datasets.Dataset(schema.empty_table())
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
        from workbench.models import resolve_model

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
