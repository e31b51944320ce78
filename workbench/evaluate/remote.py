"""``job.evaluate``: an ended run scored where its weights are, here or on its remote target.

The weights of an SSH run live on its first host (the local run directory is a mirror), so the
evaluation runs there, as the after-training one did: ``python -m workbench.evaluate.remote
RUN_DIR`` through the backend's transport, with the target's environment and secrets, reading
the request (tasks, endpoint, step) as JSON on stdin. It appends to the remote eval.jsonl (and
eval/, status.json); the new bytes are then copied into the local mirror from its own size on,
as the mirror's sync does, so a later sync stays in step. A Slurm run would need an allocation
of its own on the cluster (``srun``): it is refused with the command to run there instead.

    >>> job.evaluate(["heldout"])          # an ssh:NAME run: scored on its host  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from workbench.errors import EvalError, RemoteEvalError, WorkbenchError
from workbench.evaluate import results
from workbench.evaluate.runner import EvalReport

# How long an evaluation on the target may take (a long lm-eval suite included).
TIMEOUT_S = 6 * 3600.0
_ANSWER = "WORKBENCH-EVAL "


def evaluate_job(job: Any, tasks: Any = None, *, endpoint: str | None = None,
                 **knobs: Any) -> EvalReport:
    """``job.evaluate``: the run's final weights (its adapter/ or model/) or ``endpoint``, scored
    on ``tasks`` (default: the spec's ``eval.tasks``) with its validation split as the default
    file; lines go to the run's eval.jsonl (phase ``manual``, at the run's last step). A run
    whose directory of record is on a remote target is scored there."""
    from workbench.evaluate.runner import as_tasks, evaluate_run_dir
    from workbench.rundir import TERMINAL

    state = job.state
    if endpoint is None and state not in TERMINAL:
        raise EvalError(f"run {job.id} is {state}; wait for it to end (job.wait()) or give "
                        "eval.every_steps in the spec to score it while it trains")
    rd = job.run_dir
    if not rd.path.is_dir():
        raise EvalError(f"run {job.id}'s directory {rd.path} is not on this machine; evaluate "
                        "it where it ran (`workbench eval --run-dir DIR` on the target)")
    parsed = as_tasks(tasks if tasks is not None else job.spec.eval.tasks, **knobs)
    if placed_elsewhere(rd.path):
        return evaluate_there(job, parsed, endpoint)
    return evaluate_run_dir(rd.path, parsed, endpoint=endpoint,
                            step=int(job.status().get("step") or 0))


def placed_elsewhere(local_dir: Path) -> bool:
    """True when the run's directory of record is on another machine (SSH hosts, a Slurm
    cluster's workdir); a Slurm run kept in place on this login node is here."""
    from workbench.backends.remote import load_placement

    placement = load_placement(local_dir)
    return bool(placement.get("nodes") or placement.get("dir"))


def evaluate_there(job: Any, tasks: list[Any], endpoint: str | None) -> EvalReport:
    from workbench.backends.remote import SSHTransport, load_placement
    from workbench.backends.ssh import SSHBackend

    placement = load_placement(job.run_dir.path)
    step = int(job.status().get("step") or 0)
    request = {"tasks": [t.model_dump() for t in tasks], "endpoint": endpoint, "step": step}
    if isinstance(job.backend, SSHBackend) and placement.get("nodes"):
        target = job.backend.target
        node0 = placement["nodes"][0]
        transport = SSHTransport(target.hosts[node0["rank"]], target)
        prefix = target.remote_shell_prefix(transport, node0["dir"])
        return _run(transport, prefix, target.python, node0["dir"], job.run_dir.path, request)
    where = str(placement.get("dir") or job.run_dir.path)
    names = [f"lm_eval:{n}" for t in tasks if t.kind == "lm_eval" for n in t.tasks]
    names += [t.kind for t in tasks if t.kind != "lm_eval"]
    gpus = job.spec.resources.gpus_per_node
    python = getattr(job.backend.target, "python", "python")
    command = (f"srun --nodes=1 --ntasks=1{f' --gres=gpu:{gpus}' if gpus else ''} "
               f"{shlex.quote(python)} -m workbench.cli eval --run-dir {shlex.quote(where)} "
               f"--tasks {shlex.quote(','.join(names))}")
    raise RemoteEvalError(
        f"run {job.id} lives on the cluster of {job.target} ({where}); job.evaluate cannot ask "
        f"Slurm for an allocation to score it yet. On the cluster's login node run:\n"
        f"  {command}\n"
        "(the scores print there and go to that run directory's eval.jsonl), or deploy the run "
        "and score the endpoint: workbench.evaluate(endpoint=NAME)")


def _run(transport: Any, prefix: str, python: str, remote_dir: str, local_dir: Path,
         request: dict[str, Any]) -> EvalReport:
    from workbench.backends.remote import shell_path

    q = shell_path(remote_dir)
    res = transport.run(f"{prefix}cd {q} && {shlex.quote(python)} -m workbench.evaluate.remote "
                        f"{q}", input=json.dumps(request).encode(), check=False,
                        timeout=TIMEOUT_S)
    answer = next((json.loads(ln[len(_ANSWER):]) for ln in res.stdout.decode(errors="replace")
                   .splitlines() if ln.startswith(_ANSWER)), None)
    # Whatever was scored before a failure is in the remote eval.jsonl: bring it back first.
    _fetch(transport, python, remote_dir, local_dir)
    if answer is None:
        raise EvalError(f"the evaluation on {transport.where} ended without an answer (exit "
                        f"{res.returncode}):\n{res.text[-1500:]}\n-> check the target's "
                        "environment (`workbench targets check`)")
    if "error" in answer:
        kind = {c.__name__: c for c in _errors()}.get(answer["error"]["type"], EvalError)
        raise kind(f"on {transport.where}: {answer['error']['message']}")
    report = EvalReport(lines=answer["lines"])
    for line in report.lines:
        if line.get("examples"):
            rows = (local_dir / line["examples"]).read_text(encoding="utf-8").splitlines()
            report.examples[line["task"]] = [json.loads(r) for r in rows if r.strip()]
    return report


def _errors() -> list[type[WorkbenchError]]:
    from workbench.errors import EvalTaskError, JudgeError

    return [EvalError, EvalTaskError, JudgeError]


def _fetch(transport: Any, python: str, remote_dir: str, local_dir: Path) -> None:
    """Remote eval.jsonl bytes past the local copy's end, the example files its new lines name,
    and status.json's ``eval`` from the whole file."""
    from workbench.backends.remote import read_remote
    from workbench.rundir import RunDir

    path = local_dir / results.FILE
    size = path.stat().st_size if path.is_file() else 0
    new = read_remote(transport, remote_dir, results.FILE, size, python)
    if not new:
        return
    with path.open("ab") as fh:
        fh.write(new)
    for raw in new.decode("utf-8").splitlines():
        rel = json.loads(raw).get("examples") if raw.strip() else None
        if rel:
            dest = local_dir / rel
            dest.parent.mkdir(exist_ok=True)
            dest.write_bytes(read_remote(transport, remote_dir, rel, 0, python))
    RunDir(local_dir).write_status(eval=results.flat(results.read(local_dir)))


def main(argv: list[str] | None = None) -> int:
    """On the target: score RUN_DIR as the JSON request on stdin says; answer on stdout."""
    from workbench.evaluate.runner import evaluate_run_dir

    run_dir = (argv if argv is not None else sys.argv[1:])[0]
    request = json.loads(sys.stdin.read())
    try:
        report = evaluate_run_dir(run_dir, request["tasks"], endpoint=request.get("endpoint"),
                                  step=request.get("step"))
    except WorkbenchError as exc:
        print(_ANSWER + json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}),
              flush=True)
        return 1
    print(_ANSWER + json.dumps({"lines": report.lines}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
