"""The ``workbench`` command line: launch, sweep, status, logs, cancel, compare, eval, plan, data,
spec, demo.

Each command is a few lines over the same library calls the widgets use. ``run(argv)`` executes a
command and returns its result object (a Job, a list of Jobs, text); ``main`` prints it. The
``%workbench`` magic calls ``run`` in the kernel, so the CLI and the magics cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
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
        s = job.summary()
        return "\n".join(f"{k:>12}: {v}" for k, v in s.items() if v is not None)
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


def _demo(args: argparse.Namespace) -> Any:
    from workbench.cli.notebook import run_notebook

    run_notebook(args.notebook, timeout=args.timeout, figures=args.figures)
    return ""


def _targets_list(args: argparse.Namespace) -> Any:
    from workbench.targets.named import load_targets, target_problems, targets_file

    rows = [("TARGET", "WHERE", "PYTHON")]
    rows.append(("local", "this machine", sys.executable))
    for ref, t in load_targets().items():
        where = (", ".join(h.host for h in t.hosts) if t.kind == "ssh"
                 else f"partition {t.partition or '(default)'}"
                      + (f" via {t.login.host}" if t.login else ""))
        rows.append((ref, where, t.python))
    for ref in target_problems():  # unusable until corrected; the check says what is wrong
        rows.append((ref, f"NOT USABLE: see `workbench targets check {ref}`", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return f"{table}\n(configured in {targets_file()}; see docs/targets.md)"


def _targets_check(args: argparse.Namespace) -> Any:
    from workbench.targets.check import check_target

    report = check_target(args.name)
    print(report)
    return 0 if report.ok else 1  # scripts (and CI) can gate on a target being ready


def _targets_setup(args: argparse.Namespace) -> Any:
    from workbench.targets.setup import setup_target

    setup_target(args.name, source=args.source, progress=lambda line: print(line, flush=True))
    return 0  # setup_target printed the outcome as its last progress line


def _kernels(args: argparse.Namespace) -> Any:
    from workbench.targets.kernels.specs import install_kernel, kernels_table, remove_kernel

    if args.kernels_command == "install":
        name = install_kernel(args.target, gpus=args.gpus, time=args.time,
                              cull_idle=args.cull_idle, wait=args.wait, budget=args.budget)
        return f"installed kernel {name}; it is in JupyterLab's launcher\n{kernels_table()}"
    if args.kernels_command == "remove":
        return f"removed {remove_kernel(args.name)}"
    return kernels_table()


def _deploy(args: argparse.Namespace) -> Any:
    from workbench.serve import deploy

    # The command exits at once, so the endpoint must outlive it: `workbench undeploy` stops it.
    ep = deploy(*args.runs, name=args.name, merge=args.merge or None, host=args.host,
                port=args.port, python=args.python, target=args.target, keep=True)
    key = f"\napi key: {ep.api_key}" if ep.api_key else ""
    return f"{ep.name} healthy at {ep.api_base} serving {', '.join(ep.models)}{key}"


def _export(args: argparse.Namespace) -> Any:
    from workbench.serve.export_run import export

    report = export(args.run, [f for part in args.format for f in part.split(",")],
                    quant=args.quant.split(","), out=args.out, dtype=args.dtype)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description="Fine-tune language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("launch", help="start a run from a spec YAML file")
    c.add_argument("spec", help="path to a RunSpec YAML file (`workbench spec` prints one)")
    c.add_argument("--force", action="store_true", help="launch even if the plan does not fit")
    c.add_argument("--wait", action="store_true", help="wait for the run to end, with progress")
    c.set_defaults(func=_launch)

    c = sub.add_parser("sweep", help="start a sweep from a spec YAML file with a 'sweep:' section")
    c.add_argument("spec", help="RunSpec YAML with a 'sweep:' section (or a sweep id with --resume)")
    c.add_argument("--resume", action="store_true", help="go on with the sweep SPEC names")
    c.add_argument("--wait", action="store_true", help="wait for the sweep, then print its trials")
    c.set_defaults(func=_sweep)

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
                       "model card and checked by running it (docs/export.md)")
    c.add_argument("run", help="run id or name")
    c.add_argument("--format", action="append", default=None, required=True,
                   help="merged, gguf or ollama (repeat or comma-separate)")
    c.add_argument("--quant", default="f16", help="GGUF types, e.g. f16,q8_0,q4_k_m")
    c.add_argument("--out", help="folder (default: RUN_DIR/export)")
    c.add_argument("--dtype", default="float32", help="merged weights: float32, bfloat16, float16")
    c.set_defaults(func=_export)

    c = sub.add_parser("endpoints", help="list the endpoints")
    c.add_argument("--all", action="store_true", help="include stopped ones")
    c.set_defaults(func=_endpoints)

    c = sub.add_parser("undeploy", help="stop an endpoint")
    c.add_argument("name")
    c.set_defaults(func=_undeploy)

    c = sub.add_parser("spec", help="print the default RunSpec as YAML, a comment on each knob")
    c.add_argument("-o", "--output", help="write it to this file")
    c.set_defaults(func=_spec)

    c = sub.add_parser("demo", help="run the quickstart notebook headless, printing its outputs")
    c.add_argument("--notebook", default="notebooks/quickstart.ipynb")
    c.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    c.add_argument("--figures", help="folder for the plots, saved as PNG files "
                                     "(default: WORKBENCH_HOME/demo)")
    c.set_defaults(func=_demo)

    c = sub.add_parser("targets", help="list the configured targets, or check one")
    tsub = c.add_subparsers(dest="targets_command", required=True, metavar="ACTION")
    t = tsub.add_parser("list", help="local, ssh:NAME and slurm:NAME from targets.yaml")
    t.set_defaults(func=_targets_list)
    t = tsub.add_parser("check", help="reachability, Python env, torch, GPUs, disk (and Slurm)")
    t.add_argument("name", help="local, ssh:NAME or slurm:NAME")
    t.set_defaults(func=_targets_check)
    t = tsub.add_parser("setup", help="make the target's Python environment: this Workbench, a "
                                      "torch for its node (targets.yaml install:)")
    t.add_argument("name", help="ssh:NAME or slurm:NAME")
    t.add_argument("--source", choices=["auto", "registry", "wheels"],
                   help="where packages come from (default: install.source, else auto: the "
                        "target's registry if it reaches one, else wheels carried from here)")
    t.set_defaults(func=_targets_setup)

    c = sub.add_parser("kernels", help="remote kernels: a notebook's cells on an SSH host or Slurm")
    ksub = c.add_subparsers(dest="kernels_command", required=True, metavar="ACTION")
    k = ksub.add_parser("install", help="write a kernelspec that runs on a target")
    k.add_argument("target", help="ssh:NAME or slurm:NAME (from targets.yaml)")
    k.add_argument("--gpus", type=int, default=0, help="GPUs to allocate (Slurm) and price")
    k.add_argument("--time", default="1h", help="the allocation's time limit, e.g. 2h (Slurm)")
    k.add_argument("--cull-idle", help="end the kernel after this long idle, e.g. 30m; 0: never "
                   "(default: 1h with GPUs, never without)")
    k.add_argument("--wait", default="5m", help="how long an allocation may stay pending (Slurm)")
    k.add_argument("--budget", type=float, help="stop the kernel once it has cost this much at the "
                   "target's price (its currency); restarts count on")
    k = ksub.add_parser("list", help="the installed Workbench remote kernels")
    k = ksub.add_parser("remove", help="remove a Workbench remote kernel")
    k.add_argument("name", help="kernel name (workbench-slurm-NAME) or target")
    c.set_defaults(func=_kernels)

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
