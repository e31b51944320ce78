"""The ``workbench targets`` and ``workbench kernels`` commands: list, check and set up the
configured targets, and install, list and remove the kernelspecs of remote kernels on them
(:func:`register` adds them to the command line of :mod:`workbench.cli`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


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
                              cull_idle=args.cull_idle, wait=args.wait, budget=args.budget,
                              orphan_after=args.orphan_after)
        return f"installed kernel {name}; it is in JupyterLab's launcher\n{kernels_table()}"
    if args.kernels_command == "remove":
        return f"removed {remove_kernel(args.name)}"
    return kernels_table()


def register(sub: Any) -> None:
    """Add ``targets`` and ``kernels`` to an argparse subparsers object."""
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
    k.add_argument("--orphan-after", help="end the kernel this long after its notebook's server "
                   "is gone, e.g. 2m (default 30s, at least 10s)")
    k = ksub.add_parser("list", help="the installed Workbench remote kernels")
    k = ksub.add_parser("remove", help="remove a Workbench remote kernel")
    k.add_argument("name", help="kernel name (workbench-slurm-NAME) or target")
    c.set_defaults(func=_kernels)
