"""The ``workbench data`` command: ``clean IN OUT`` and ``split IN OUTDIR``.

A thin adapter from argparse to :func:`workbench.data.clean.clean_file` and
:func:`workbench.data.split.split_file`; errors are the library's typed errors, printed as they
are. ``python -m workbench.data.commands data clean ...`` runs it without the main CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from workbench.errors import WorkbenchError


def _clean(args: argparse.Namespace) -> int:
    from workbench.data.clean import clean_file

    steps = [s.strip() for s in args.steps.split(",") if s.strip()] if args.steps else None
    options = json.loads(args.options) if args.options else None
    report = clean_file(args.input, args.output, steps=steps, options=options,
                        text_fields=args.text_field, workers=args.workers,
                        report_path=args.report, progress=not args.quiet)
    print(report.summary())
    print(f"report: {args.report or str(args.output) + '.report.json'}")
    return 0


def _split(args: argparse.Namespace) -> int:
    from workbench.data.split import split_file

    counts = split_file(args.input, args.outdir, fraction=args.fraction, seed=args.seed,
                        text_fields=args.text_field)
    print(f"train: {counts['train']} rows, validation: {counts['validation']} rows "
          f"-> {args.outdir}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``data`` command (with ``clean`` and ``split``) to an argparse subparsers object."""
    from workbench.data.clean.pipeline import DEFAULT_STEPS, STEPS

    data = subparsers.add_parser("data", help="clean and split datasets")
    sub = data.add_subparsers(dest="data_command", required=True)

    clean = sub.add_parser("clean", help="clean a .jsonl/.txt corpus into a .jsonl file",
                           description="Steps (default order): " + ", ".join(DEFAULT_STEPS))
    clean.add_argument("input", help="input .jsonl (one JSON object per line) or .txt file")
    clean.add_argument("output", help="output .jsonl of kept (scrubbed) rows")
    clean.add_argument("--steps", help="comma-separated steps, in order; known: "
                       + ", ".join(STEPS) + " (default: all, in the order above)")
    clean.add_argument("--options", help='per-step options as JSON, e.g. '
                       '\'{"quality": {"min_words": 5}}\'')
    clean.add_argument("--text-field", action="append", default=None,
                       help="field holding the text (repeat for several; default: text)")
    clean.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    clean.add_argument("--report", default=None, help="report JSON path "
                       "(default: OUTPUT.report.json)")
    clean.add_argument("--quiet", action="store_true", help="no progress bar")
    clean.set_defaults(func=_run(_clean))

    split = sub.add_parser("split", help="split a corpus into train/validation by content hash")
    split.add_argument("input", help="input .jsonl or .txt file")
    split.add_argument("outdir", help="folder for train.jsonl and validation.jsonl")
    split.add_argument("--fraction", type=float, default=0.1, help="validation share (0.1)")
    split.add_argument("--seed", type=int, default=42, help="hash seed (42)")
    split.add_argument("--text-field", action="append", default=None,
                       help="field holding the text (repeat for several; default: text)")
    split.set_defaults(func=_run(_split))


def _run(handler: Any) -> Any:
    def func(args: argparse.Namespace) -> int:
        args.text_field = args.text_field or ["text"]
        try:
            return int(handler(args))
        except (WorkbenchError, json.JSONDecodeError) as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2

    return func


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
