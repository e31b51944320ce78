"""One prepared jsonl split tokenised: an Arrow table of input_ids/labels and its statistics.

Rows are read ``_BATCH`` at a time, rendered with the model's chat template and encoded by the
Rust tokenizer in a thread while this one labels the previous batch
(:mod:`workbench.data.tokenize` does the per-example work); the columns are built as one flat
array plus offsets each. :mod:`workbench.data.tokenized` stores the result for a run.

    >>> table, stats = tokenize_split(path, spec, tokenizer)  # doctest: +SKIP
    >>> table.column_names, stats.dropped
    (['input_ids', 'labels'], 0)
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench.data.batches import pack
from workbench.data.stats import SplitStats
from workbench.data.tokenize import (
    ChatRenderer,
    Rendered,
    encode_rendered,
    finish_batch,
    render_batch,
)
from workbench.spec import RunSpec

_BATCH = 1000

Progress = Callable[[str, int, int], None]


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
        return (_table(pack(kept, d.max_length)) if kept else empty_table()), stats
    if len(offsets) == 1:
        return empty_table(), stats
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


def empty_table() -> Any:
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    return schema.empty_table()
