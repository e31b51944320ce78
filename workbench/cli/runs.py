"""The ``workbench`` commands about runs: launch, status, logs, cancel, resume, compare,
reproduce, plan and spec, each a few lines over the library calls the widgets use
(:func:`register` adds them to the command line of :mod:`workbench.cli`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs.readable import clock


def _fmt_duration(s: float | None) -> str:
    return "-" if s is None else clock(int(s))


def status_table(jobs: list[Any]) -> str:
    rows = [("RUN", "TARGET", "STATE", "STEP", "LOSS", "ETA")]
    for job in jobs:
        s = job.summary()
        step = f"{s['step'] or 0}/{s['total_steps'] or '?'}"
        loss = f"{s['last_loss']:.4f}" if s["last_loss"] is not None else "-"
        eta = _fmt_duration(s["eta_s"]) if s["state"] == "running" else "-"
        state = (s["state"] or "-") + (f" ({s['queue_reason']})" if s.get("queue_reason") else "")
        rows.append((job.id, job.target, state, step, loss, eta))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _launch(args: argparse.Namespace) -> Any:
    from workbench.runs.launching import launch

    job = launch(args.spec, force=args.force)
    print(f"launched {job.id}  (run dir {job.run_dir.path})", flush=True)
    if args.wait:
        state = job.wait(progress=True)
        print(f"{job.id} {state}")
        if state != "succeeded":
            s = job.summary()
            print(s["error"] or s["note"] or "", file=sys.stderr)
    return job


def _status(args: argparse.Namespace) -> Any:
    from workbench.runs.jobs import get_job, jobs

    if args.run:
        job = get_job(args.run)
        # As a notebook shows it: rounded, times in units, money as it reads (runs.money).
        return "\n".join(f"{k:>12}: {v}" for k, v in job.summary().shown_items())
    return status_table(jobs(limit=args.limit))


def _logs(args: argparse.Namespace) -> Any:
    from workbench.runs.jobs import get_job

    job = get_job(args.run)
    if not args.follow:
        return job.logs(tail=args.tail, name=args.name)
    offsets: dict[str, int] = {}
    while True:  # follow: print new bytes of every log until the run ends
        for path in job.run_dir.log_files():
            data = job.backend.read(job.run_dir.path, f"logs/{path.name}", offsets.get(path.name, 0))
            if data:
                offsets[path.name] = offsets.get(path.name, 0) + len(data)
                sys.stdout.write(data.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        if job.done:
            return ""
        time.sleep(0.5)


def _cancel(args: argparse.Namespace) -> Any:
    from workbench.runs.jobs import get_job

    job = get_job(args.run)
    return f"{job.id} {job.cancel()}"


def _resume(args: argparse.Namespace) -> Any:
    from workbench.runs.jobs import get_job

    changes: dict[str, Any] = {}
    if args.budget is not None:
        changes["budget.limit"] = args.budget
    if args.max_steps is not None:
        changes["train.max_steps"] = args.max_steps
    job = get_job(args.run).resume(**changes)
    return f"resumed {job.id} ({job.state})"


def _compare(args: argparse.Namespace) -> Any:
    from workbench.widgets.compare import compare_df, compare_figure, compare_table

    table = compare_table(compare_df(args.runs))
    if args.html:
        compare_figure(args.runs, metric=args.metric).write_html(args.html, include_plotlyjs=True)
        table += f"\nwrote {args.html}"
    return table


def _reproduce(args: argparse.Namespace) -> Any:
    from workbench.runs.reproduce import compare_bundle

    report = compare_bundle(args.bundle)
    if args.spec_out:
        report.spec.save(args.spec_out)
    return report.summary() + (f"\nwrote {args.spec_out}" if args.spec_out else "")


def _plan(args: argparse.Namespace) -> Any:
    from workbench.plan import plan
    from workbench.spec import RunSpec

    if args.check:
        from workbench.plan.history import check_report
        from workbench.runs.jobs import get_job

        return check_report(get_job(args.check).run_dir)
    if not args.spec:
        raise WorkbenchError("give a spec file to plan, or --check RUN to compare a run's plan "
                             "with what it measured")
    return plan(RunSpec.from_yaml(args.spec), gpu_type=args.gpu_type).summary()


def _spec(args: argparse.Namespace) -> Any:
    from workbench.spec import RunSpec
    from workbench.spec.knobs import commented_yaml

    text = commented_yaml(RunSpec())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
        return f"wrote {args.output}"
    return text.rstrip()


def register(sub: Any) -> None:
    """Add the run commands to an argparse subparsers object."""
    c = sub.add_parser("launch", help="start a run from a spec YAML file")
    c.add_argument("spec", help="path to a RunSpec YAML file (`workbench spec` prints one)")
    c.add_argument("--force", action="store_true", help="launch even if the plan does not fit")
    c.add_argument("--wait", action="store_true", help="wait for the run to end, with progress")
    c.set_defaults(func=_launch)

    c = sub.add_parser("status", help="list runs, or show one run")
    c.add_argument("run", nargs="?", help="run id or name")
    c.add_argument("--limit", type=int, default=20)
    c.set_defaults(func=_status)

    c = sub.add_parser("logs", help="print a run's logs")
    c.add_argument("run")
    c.add_argument("--tail", type=int, default=50, help="lines per log file")
    c.add_argument("--name", help="one log file, e.g. rank-0.log")
    c.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    c.set_defaults(func=_logs)

    c = sub.add_parser("cancel", help="stop a run")
    c.add_argument("run")
    c.set_defaults(func=_cancel)

    c = sub.add_parser("resume", help="restart an ended run from its newest verified snapshot")
    c.add_argument("run")
    c.add_argument("--budget", type=float, help="a new budget limit (e.g. after a budget stop)")
    c.add_argument("--max-steps", type=int, help="train longer than first asked")
    c.set_defaults(func=_resume)

    c = sub.add_parser("compare", help="compare runs: losses, eval scores, spec differences")
    c.add_argument("runs", nargs="+", metavar="RUN", help="two or more run ids or names")
    c.add_argument("--html", metavar="FILE",
                   help="also write the overlaid curves (by step and by tokens) as standalone HTML")
    c.add_argument("--metric", default="loss", help="the series drawn in --html (default: loss)")
    c.set_defaults(func=_compare)

    c = sub.add_parser("reproduce", help="re-create a run's spec from reproduce.zip and diff envs")
    c.add_argument("bundle", help="RUN_DIR/reproduce.zip")
    c.add_argument("--spec-out", help="write the run's spec here")
    c.set_defaults(func=_reproduce)

    c = sub.add_parser("plan", help="memory, strategy, time and cost of a spec, before launch")
    c.add_argument("spec", nargs="?")
    c.add_argument("--gpu-type", help="plan for this GPU type (see workbench/targets/gpus.py)")
    c.add_argument("--check", metavar="RUN", help="planned against measured for a run")
    c.set_defaults(func=_plan)

    c = sub.add_parser("spec", help="print the default RunSpec as YAML, a comment on each knob")
    c.add_argument("-o", "--output", help="write it to this file")
    c.set_defaults(func=_spec)
