"""The ``workbench`` command line: launch, sweep, status, logs, cancel, compare, eval, plan, data,
spec, demo.

Each command is a few lines over the same library calls the widgets use. ``run(argv)`` executes a
command and returns its result object (a Job, a list of Jobs, text); ``main`` prints it. The
``%workbench`` magic calls ``run`` in the kernel, so the CLI and the magics cannot drift apart.

This module builds the parser and holds the commands of sweeps, endpoints, export, credit, course
and demo; the run commands are in :mod:`workbench.cli.runs` (``status_table`` is importable from
here too), the target and kernel commands in :mod:`workbench.cli.targets`, and ``data`` and
``eval`` in their packages' ``commands`` modules.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from workbench.cli.runs import register as register_runs
from workbench.cli.runs import status_table
from workbench.cli.targets import register as register_targets
from workbench.errors import WorkbenchError

__all__ = ["build_parser", "main", "run", "status_table"]


def _deploy(args: argparse.Namespace) -> Any:
    from workbench.serve import deploy

    # The command exits at once, so the endpoint must outlive it: `workbench undeploy` stops it.
    ep = deploy(*args.runs, name=args.name, merge=args.merge or None, host=args.host,
                port=args.port, python=args.python, target=args.target, keep=True)
    key = f"\napi key: {ep.api_key}" if ep.api_key else ""
    return f"{ep.name} healthy at {ep.api_base} serving {', '.join(ep.models)}{key}"


def _export(args: argparse.Namespace) -> Any:
    from workbench.serve.export_run import export

    formats = [f for part in args.format for f in part.split(",")]
    if args.plan:
        return repr(export(args.run, formats, quant=args.quant.split(","), dtype=args.dtype,
                           plan_only=True))
    report = export(args.run, formats, quant=args.quant.split(","), out=args.out,
                    dtype=args.dtype)
    return repr(report)


def _endpoints(args: argparse.Namespace) -> Any:
    from workbench.serve import endpoints, endpoints_table

    return endpoints_table(endpoints(all=args.all))


def _sweep(args: argparse.Namespace) -> Any:
    from workbench.sweep import get_sweep, sweep_yaml

    s = get_sweep(args.spec) if args.resume else sweep_yaml(args.spec)
    if args.resume:
        s.resume()
    print(f"sweep {s.id}  (record {s.record.path})", flush=True)
    if args.wait:
        print(f"{s.id} {s.wait(progress=True)}")
        return s.trials_df().to_string(index=False)
    return s


def _undeploy(args: argparse.Namespace) -> Any:
    from workbench.serve import undeploy

    return undeploy(args.name)


def _credit(args: argparse.Namespace) -> Any:
    from workbench.runs.credit import credit

    if args.action == "set":
        return credit(args.amount, args.currency)
    wallet = credit()
    if args.action == "add":
        wallet.add(args.amount, note="added from the command line")
    elif args.action == "history":
        return wallet.history_text()
    return wallet


def _course(args: argparse.Namespace) -> Any:
    from workbench.course import config

    if args.course_command == "start":
        return config.start(args.course_file)
    return f"wrote {config.init(args.course_file)}"


def _demo(args: argparse.Namespace) -> Any:
    from workbench.cli.notebook import run_notebook

    run_notebook(args.notebook, timeout=args.timeout, figures=args.figures)
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description="Fine-tune language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_runs(sub)

    c = sub.add_parser("sweep", help="start a sweep from a spec YAML file with a 'sweep:' section")
    c.add_argument("spec", help="RunSpec YAML with a 'sweep:' section (or a sweep id with --resume)")
    c.add_argument("--resume", action="store_true", help="go on with the sweep SPEC names")
    c.add_argument("--wait", action="store_true", help="wait for the sweep, then print its trials")
    c.set_defaults(func=_sweep)

    c = sub.add_parser("deploy", help="serve runs (LoRA adapters or merged) with vLLM")
    c.add_argument("runs", nargs="+", help="run ids/names (several adapters share one base)")
    c.add_argument("--name", help="endpoint name (default: from the first run)")
    c.add_argument("--merge", action="store_true", help="serve merged weights, not base + LoRA")
    c.add_argument("--target", default="local",
                   help="local, ssh:NAME (reached through a tunnel) or slurm:NAME (a batch job)")
    c.add_argument("--host", help="bind address (default: loopback; on Slurm every interface); "
                   "beyond loopback an API key is set")
    c.add_argument("--port", type=int, help="port (default: a free one)")
    c.add_argument("--python", help="the Python that has vLLM (default: WORKBENCH_SERVE_PYTHON)")
    c.set_defaults(func=_deploy)

    c = sub.add_parser("export", help="merged weights, GGUF or an Ollama Modelfile, each with a "
                       "model card and checked by running it, where the run's weights are "
                       "(this machine, its SSH host or Slurm cluster; docs/export.md)")
    c.add_argument("run", help="run id or name")
    c.add_argument("--format", action="append", default=None, required=True,
                   help="merged, gguf or ollama (repeat or comma-separate)")
    c.add_argument("--quant", default="f16", help="GGUF types, e.g. f16,q8_0,q4_k_m")
    c.add_argument("--out", help="folder (default: RUN_DIR/export)")
    c.add_argument("--dtype", default="float32", help="merged weights: float32, bfloat16, float16")
    c.add_argument("--plan", "--dry-run", action="store_true",
                   help="print the disk, memory and time it needs, and export nothing")
    c.set_defaults(func=_export)

    c = sub.add_parser("endpoints", help="list the endpoints")
    c.add_argument("--all", action="store_true", help="include stopped ones")
    c.set_defaults(func=_endpoints)

    c = sub.add_parser("undeploy", help="stop an endpoint")
    c.add_argument("name")
    c.set_defaults(func=_undeploy)

    c = sub.add_parser("demo", help="run the quickstart notebook headless, printing its outputs")
    c.add_argument("--notebook", default="notebooks/quickstart.ipynb")
    c.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    c.add_argument("--figures", help="folder for the plots, saved as PNG files "
                                     "(default: WORKBENCH_HOME/demo)")
    c.set_defaults(func=_demo)

    register_targets(sub)

    c = sub.add_parser("credit", help="the wallet every run, sweep, evaluation and endpoint "
                       "draws from: show, set, add, history")
    c.add_argument("action", nargs="?", choices=("show", "set", "add", "history"), default="show")
    c.add_argument("amount", nargs="?", type=float)
    c.add_argument("currency", nargs="?", default="CNY")
    c.set_defaults(func=_credit)

    c = sub.add_parser("course", help="a class on JupyterHub with a credit per student "
                                      "(docs/course.md)")
    csub = c.add_subparsers(dest="course_command", required=True, metavar="ACTION")
    for action, helptext in (("init", "write the hub config and the service's config"),
                             ("start", "init, then run the hub (as root, for PAM users)")):
        t = csub.add_parser(action, help=helptext)
        t.add_argument("course_file", help="course.yaml (see docs/course.md)")
        t.set_defaults(func=_course)

    from workbench.data.commands import register as register_data

    register_data(sub)
    from workbench.evaluate.commands import register as register_eval

    register_eval(sub)
    return p


def run(argv: Sequence[str]) -> Any:
    """Parse ``argv`` and run the command; return its result (raises WorkbenchError)."""
    args = build_parser().parse_args(list(argv))
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        result = run(sys.argv[1:] if argv is None else argv)
    except WorkbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if isinstance(result, int):
        return result
    if result not in (None, ""):
        print(result if isinstance(result, str) else repr(result))
    return 0
