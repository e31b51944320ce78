"""What the planner reads of a run's data before launch: row counts, a sample, token statistics.

:func:`source_rows` counts each source's rows and keeps a sample of text rows for a
characters-per-token guess; :func:`token_sample` measures the first rows with the model's own
tokenizer and chat template (for a vision-language model, its processor, so each image counts the
tokens its size becomes) where they can be loaded without the network.
:mod:`workbench.plan.timing` turns both into the run's tokens per example.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from workbench.spec import RunSpec

CHARS_PER_TOKEN = 3.6  # English BPE average (OpenAI's rule of thumb: ~4 chars per token)
TEMPLATE_TOKENS = 12  # chat template / role markers around each example
SAMPLE_ROWS = 512  # rows per source tokenised for the estimate: quick, and enough for a p95


def text_chars(row: dict[str, Any]) -> int:
    total = 0
    for value in row.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):  # messages / conversations
            total += sum(len(str(m.get("content", m.get("value", ""))))
                         if isinstance(m, dict) else len(str(m)) for m in value)
    return total


def source_rows(path: str) -> tuple[int | None, list[dict[str, Any]]]:
    """(row count, a sample of text rows) of one data source; count None when not cheaply known.
    A row with an image takes no part in the sample: an image is many tokens whose count depends
    on its size, not on characters."""
    from workbench.data.formats import row_has_image

    if path == "builtin:teaching":
        from workbench.assets.teaching import teaching_rows

        rows = list(teaching_rows("train"))
        return len(rows), rows[:SAMPLE_ROWS]
    if path.startswith("builtin:"):  # a built-in image set: its jsonl, written once
        from workbench.assets.teaching import builtin_dataset_path
        from workbench.errors import WorkbenchError

        try:
            path = str(builtin_dataset_path(path))
        except WorkbenchError:
            return None, []
    p = Path(os.path.expanduser(path))
    if p.is_file() and p.suffix == ".jsonl":
        sample: list[dict[str, Any]] = []
        count = 0
        with p.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                count += 1
                if count <= SAMPLE_ROWS:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and not row_has_image(obj):
                        sample.append(obj)
        return count, sample
    if p.is_file() and p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(p).metadata.num_rows, []
    return None, []


def _local_folder(spec: RunSpec) -> str | None:
    """The run's model folder if its files are here without the network (built-in, a local
    folder, or a hub id already in the local cache); None otherwise."""
    from workbench.spec.models import resolve_model

    source = resolve_model(spec.model.id)
    if Path(source).exists():
        return source
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "tokenizer_config.json", revision=spec.model.revision)
    return str(Path(cached).parent) if isinstance(cached, str) else None


def token_sample(spec: RunSpec) -> tuple[Any, str | None]:
    """(TokenStats of each source's first rows, or None when the tokenizer or the data cannot be
    read here (the planner then guesses); the error's message when the data could not be read)."""
    from workbench.data.tokenized import cached_stats, files_key
    from workbench.errors import WorkbenchError
    from workbench.spec.models import is_vision_model

    try:
        folder = _local_folder(spec)
    except (OSError, ValueError, ImportError, WorkbenchError):
        folder = None
    try:
        if folder is not None and is_vision_model(folder, local_only=True):
            from workbench.data.vision import spec_processor, vision_token_stats

            return vision_token_stats(spec, spec_processor(spec, folder),
                                      max_rows=SAMPLE_ROWS), None
    except (OSError, ValueError, ImportError, WorkbenchError) as err:
        return None, (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:  # the same data tokenised before, known from its files: every row, no tokenizer
        cached = cached_stats(files_key(spec))
    except OSError:
        cached = None
    if cached is not None:
        return cached, None
    try:
        from workbench.data.tokenize import load_tokenizer

        tokenizer = load_tokenizer(spec, folder) if folder is not None else None
    except (OSError, ValueError, ImportError, WorkbenchError):
        tokenizer = None
    if tokenizer is None:
        return None, None
    from workbench.data.tokenized import token_stats

    try:
        return token_stats(spec, tokenizer=tokenizer, max_rows=SAMPLE_ROWS), None
    except (OSError, ValueError, WorkbenchError) as err:  # planned without it, saying why
        return None, (str(err).strip().splitlines() or [type(err).__name__])[0]
