"""Data cleaning for fine-tuning corpora (Chinese and English): composable, streaming, parallel.

Default pipeline, in order (``DEFAULT_STEPS``): ``normalize`` (Unicode + whitespace) ->
``length`` -> ``langid`` (bundled fastText lid.176) -> ``exact_dedup`` -> ``quality`` (Gopher, C4,
FineWeb rules) -> ``toxicity`` (bundled en/zh word lists) -> ``near_dedup`` (MinHash LSH,
CJK-aware shingles) -> ``pii`` (emails, phones incl. Chinese mobiles, IPs, ID and card numbers).
Each step's docstring gives its defaults and where they come from. Splitting into
train/validation is :func:`workbench.data.split.split_file` (by content hash, stable on append).

For the training pipeline, with ``spec.data.clean.enabled``::

    pipeline = CleanPipeline.from_spec(spec.data.clean)      # SpecError on bad steps/options
    rows, report = pipeline.run(records, text_fields=["instruction", "input", "output"])
    for row in rows:      # kept rows (text fields possibly scrubbed), lazily, in input order
        ...
    report.to_dict()      # complete once ``rows`` is exhausted; report.to_json(path) on disk

Alone: ``clean_file("raw.jsonl", "clean.jsonl")`` or ``workbench data clean IN OUT``; in a
notebook, ``report.widget()`` (or ``report.plot()``) shows what was removed and why.

    >>> rows, report = clean_records([{"text": "mail a@b.com  now"}], steps=["normalize", "pii"],
    ...                              workers=1, progress=False)
    >>> rows[0]["text"]
    'mail <EMAIL> now'
"""

from workbench.data.clean.dedup import ExactDedup, MinHasher, NearDedup
from workbench.data.clean.langid import LanguageFilter
from workbench.data.clean.length import LengthFilter
from workbench.data.clean.normalize import Normalize
from workbench.data.clean.pii import PIIScrubber
from workbench.data.clean.pipeline import (
    DEFAULT_STEPS,
    STEPS,
    CleanPipeline,
    build_steps,
    clean_file,
    clean_records,
)
from workbench.data.clean.quality import QualityFilter
from workbench.data.clean.reading import read_records, write_records
from workbench.data.clean.report import CleanReport
from workbench.data.clean.step import Doc, Step
from workbench.data.clean.toxicity import ToxicityFilter

__all__ = [
    "DEFAULT_STEPS",
    "STEPS",
    "CleanPipeline",
    "CleanReport",
    "Doc",
    "ExactDedup",
    "LanguageFilter",
    "LengthFilter",
    "MinHasher",
    "NearDedup",
    "Normalize",
    "PIIScrubber",
    "QualityFilter",
    "Step",
    "ToxicityFilter",
    "build_steps",
    "clean_file",
    "clean_records",
    "read_records",
    "write_records",
]
