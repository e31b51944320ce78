"""``workbench eval RUN | --run-dir DIR | --endpoint NAME``: the CLI over :mod:`workbench.evaluate`."""

from __future__ import annotations

import argparse
from typing import Any


def _eval(args: argparse.Namespace) -> Any:
    from workbench.errors import EvalError

    knobs = {"file": args.file, "max_samples": args.max_samples,
             "max_new_tokens": args.max_new_tokens, "judge": args.judge}
    tasks = args.tasks.split(",") if args.tasks else None
    if args.run_dir:
        from workbench.evaluate.runner import evaluate_run_dir

        report = evaluate_run_dir(args.run_dir, tasks, endpoint=args.endpoint, **knobs)
    elif args.run:
        from workbench.runs.jobs import get_job

        report = get_job(args.run).evaluate(tasks, endpoint=args.endpoint, **knobs)
    elif args.endpoint:
        from workbench.evaluate.runner import evaluate

        report = evaluate(tasks=tasks or ["heldout"], endpoint=args.endpoint, **knobs)
    else:
        raise EvalError("give a run (workbench eval RUN), --run-dir DIR or --endpoint NAME_OR_URL")
    return report_table(report.lines)


def report_table(lines: list[dict[str, Any]]) -> str:
    rows = [("TASK", "MODEL", "STEP", "N", "METRICS")]
    for ln in lines:
        metrics = "  ".join(f"{k}={v:.4g}" for k, v in ln["metrics"].items())
        rows.append((ln["task"], ln["model"], str(ln["step"]), str(ln["n"]), metrics))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths)), r[4]]).rstrip()
                     for r in rows)


def register(sub: Any) -> None:
    c = sub.add_parser("eval", help="score a run's weights or an endpoint (heldout, perplexity, "
                                    "lm_eval:TASK, judge)")
    c.add_argument("run", nargs="?", help="run id or name (its weights; its data's validation "
                                          "split is the default file)")
    c.add_argument("--run-dir", help="score this run directory in place, without the registry "
                                     "(on a remote run's target)")
    c.add_argument("--endpoint", help="a Workbench endpoint name or an OpenAI-compatible URL")
    c.add_argument("--tasks", help="comma-separated: heldout,perplexity,judge,lm_eval:NAME "
                                   "(default: the run's eval.tasks, else heldout)")
    c.add_argument("--file", help="prompts + answers (heldout, judge) or text (perplexity)")
    c.add_argument("--max-samples", type=int)
    c.add_argument("--max-new-tokens", type=int)
    c.add_argument("--judge", help="judge endpoint name or URL (for the judge task)")
    c.set_defaults(func=_eval)
