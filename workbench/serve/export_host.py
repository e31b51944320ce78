"""The host's side of an export on a run's target: ``python -m workbench.serve.export_host RUN_DIR``
with the request (formats, quant, dtype, verify, max_new_tokens, prompts) as JSON on stdin.

It exports RUN_DIR (this host's run directory, the one of record) into RUN_DIR/export (or the
request's ``out``, for a Slurm run kept in place on the notebook's login node) with the
same checks and refusals as on a notebook's machine, and prints one line ``WORKBENCH-EXPORT
{...}``: the folders written on this host, the checks' figures and the plan, or the error. The
notebook's side (:mod:`workbench.serve.export_remote`) holds and charges a wallet, so nothing is
charged here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.serve.export_plan import plan_for
from workbench.serve.export_remote import ANSWER
from workbench.serve.export_run import _refuse_before_work, export_here
from workbench.serve.export_source import resolve_run, validate


def main(argv: list[str] | None = None) -> int:
    run_dir = Path((argv if argv is not None else sys.argv[1:])[0]).expanduser()
    request = json.loads(sys.stdin.read())
    try:
        fmts, types = validate(request["formats"], request["quant"], request["dtype"])
        src = resolve_run(run_dir)
        src.remote = None  # this host is where the run directory is
        plan = plan_for(src, fmts, types, request["dtype"], request.get("verify", True),
                        int(request.get("max_new_tokens", 16)))
        root = Path(request["out"]) if request.get("out") else src.run_dir / "export"
        _refuse_before_work(src, fmts, types, root, plan)
        print(f"[export] on this host: {plan.headline()}", flush=True)
        report = export_here(src, fmts, types, root, dtype=request["dtype"],
                             verify=request.get("verify", True),
                             max_new_tokens=int(request.get("max_new_tokens", 16)),
                             prompts=request.get("prompts") or None,
                             say=lambda m: print(f"[export] {m}", flush=True))
    except WorkbenchError as exc:
        print(ANSWER + json.dumps({"error": str(exc), "type": type(exc).__name__}), flush=True)
        return 1
    print(ANSWER + json.dumps({"folders": {k: str(v) for k, v in report.folders.items()},
                               "checks": report.checks, "seconds": report.seconds,
                               "plan": plan.to_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
