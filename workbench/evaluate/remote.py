"""``job.evaluate``: an ended run scored where its weights are, here or on its remote target.

The weights of an SSH run live on its first host (the local run directory is a mirror), so the
evaluation runs there, as the after-training one did: ``python -m workbench.evaluate.remote
RUN_DIR`` through the backend's transport, with the target's environment and secrets, reading
the request (tasks, endpoint, step) as JSON on stdin. It appends to the remote eval.jsonl (and
eval/, status.json); the new bytes are then copied into the local mirror from its own size on,
as the mirror's sync does, so a later sync stays in step. A Slurm run is scored the same way in
a job of its own on the cluster (``srun`` from the login node, on the run's partition with its
GPUs per node: :func:`workbench.targets.backends.slurm_script.eval_srun_command`), in the cluster's run
directory; a run kept in place on this login node is scored there too, on a compute node, and
its eval.jsonl needs no copying back.

    >>> job.evaluate(["heldout"])          # an ssh:NAME or slurm:NAME run  # doctest: +SKIP
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from workbench.errors import EvalError, WorkbenchError
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
    from workbench.evaluate.runner import as_tasks
    from workbench.runs.rundir import TERMINAL

    state = job.state
    if endpoint is None and state not in TERMINAL:
        raise EvalError(f"run {job.id} is {state}; wait for it to end (job.wait()) or give "
                        "eval.every_steps in the spec to score it while it trains")
    rd = job.run_dir
    if not rd.path.is_dir():
        raise EvalError(f"run {job.id}'s directory {rd.path} is not on this machine; evaluate "
                        "it where it ran (`workbench eval --run-dir DIR` on the target)")
    parsed = as_tasks(tasks if tasks is not None else job.spec.eval.tasks, **knobs)
    from workbench.runs.wallet import Wallet

    wallet = Wallet.open()
    held, limit = None, None
    if wallet is not None and endpoint is None:  # an endpoint's time is metered on its own
        minutes = float(wallet.settings["eval_hold_minutes"])
        held = wallet.hold_time(job.spec, minutes, f"evaluation of {job.id}", "evaluate",
                                job.id, str(rd.path))
        limit = minutes * 60 if held is not None else None
    started = time.time()
    try:
        return _evaluate(job, parsed, endpoint, limit)
    finally:
        if held is not None:  # charged by the second, at most its hold
            wallet.charge_time(*held, time.time() - started,  # type: ignore[union-attr]
                               f"evaluate {job.id}")


def _evaluate(job: Any, parsed: list[Any], endpoint: str | None,
              limit: float | None = None) -> EvalReport:
    """Score where the weights are; on this machine, stopped at ``limit`` seconds (the
    wallet's hold)."""
    from workbench.evaluate.runner import evaluate_run_dir
    from workbench.runs.deadline import stop_at
    from workbench.targets.backends.slurm import SlurmBackend

    if isinstance(job.backend, SlurmBackend):  # on a compute node, in place or on the cluster
        return evaluate_on_slurm(job, parsed, endpoint)
    if placed_elsewhere(job.run_dir.path):
        return evaluate_there(job, parsed, endpoint)
    minutes = f"{limit / 60:g}" if limit else ""
    with stop_at(limit, EvalError, f"the evaluation of {job.id} was stopped at its wallet hold "
                 f"({minutes} min) and charged it; allow more with "
                 "workbench.credit(eval_hold_minutes=...), or score fewer examples "
                 "(max_samples=)"):
        return evaluate_run_dir(job.run_dir.path, parsed, endpoint=endpoint,
                                step=int(job.status().get("step") or 0))


def placed_elsewhere(local_dir: Path) -> bool:
    """True when the run's directory of record is on another machine (SSH hosts, a Slurm
    cluster's workdir); a Slurm run kept in place on this login node is here (but is scored
    on a compute node all the same: :func:`evaluate_on_slurm`)."""
    from workbench.targets.backends.remote import load_placement

    placement = load_placement(local_dir)
    return bool(placement.get("nodes") or placement.get("dir"))


def evaluate_there(job: Any, tasks: list[Any], endpoint: str | None) -> EvalReport:
    """An SSH run: on its first host, where rank 0 wrote the weights."""
    from workbench.targets.backends.remote import load_placement, on_first_host

    placement = load_placement(job.run_dir.path)
    if not placement.get("nodes"):
        raise EvalError(f"run {job.id} has no record of the host it ran on (remote.json); "
                        "score its weights where they are: `workbench eval --run-dir DIR` there")
    target = job.backend.target
    node0 = placement["nodes"][0]
    transport, command = on_first_host(target, node0, "workbench.evaluate.remote")
    return _run(transport, command, _request(job, tasks, endpoint), job.run_dir.path,
                fetch_from=(target.python, node0["dir"]))


def evaluate_on_slurm(job: Any, tasks: list[Any], endpoint: str | None) -> EvalReport:
    """A Slurm run: ``srun`` from the login node, one task in a job of its own on the run's
    partition; the lines go to the run directory of record (the cluster's workdir copy, then
    fetched into the mirror, or this one used in place)."""
    from workbench.targets.backends.remote import load_placement
    from workbench.targets.backends.slurm_script import eval_srun_command
    from workbench.targets.secrets import env_file_path, remote_quote, split_env

    backend = job.backend
    target, transport = backend.target, backend.transport
    cluster_dir = load_placement(job.run_dir.path).get("dir")
    where = cluster_dir or str(job.run_dir.path.resolve())
    # The secrets of the target's env reach the job step through the login shell's environment
    # (srun passes it on), from the owner-only file beside the run directory.
    prefix = target.remote_shell_prefix(transport, where)
    command = prefix + eval_srun_command(target, job.spec.resources.gpus_per_node, where,
                                         f"wb-eval-{job.run_dir.path.name}")
    try:
        return _run(transport, command, _request(job, tasks, endpoint), job.run_dir.path,
                    fetch_from=(target.python, cluster_dir) if cluster_dir else None)
    finally:
        if split_env(target.env)[1]:
            # The run's own copy went when it ended (SlurmBackend._remove_secret_env): so does
            # this one, once the evaluation has read it.
            transport.run(f"rm -f {remote_quote(env_file_path(where))}", check=False, timeout=60)


def _request(job: Any, tasks: list[Any], endpoint: str | None) -> dict[str, Any]:
    return {"tasks": [t.model_dump() for t in tasks], "endpoint": endpoint,
            "step": int(job.status().get("step") or 0)}


def _run(transport: Any, command: str, request: dict[str, Any], local_dir: Path,
         fetch_from: tuple[str, str] | None) -> EvalReport:
    """Run ``command`` (``workbench.evaluate.remote``) with ``request`` on stdin and read its
    answer; ``fetch_from`` (python, remote dir): copy the new eval.jsonl bytes from there."""
    res = transport.run(command, input=json.dumps(request).encode(), check=False,
                        timeout=TIMEOUT_S)
    answer = next((json.loads(ln[len(_ANSWER):]) for ln in res.stdout.decode(errors="replace")
                   .splitlines() if ln.startswith(_ANSWER)), None)
    # Whatever was scored before a failure is in the remote eval.jsonl: bring it back first.
    if fetch_from is not None:
        _fetch(transport, fetch_from[0], fetch_from[1], local_dir)
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
    from workbench.runs.rundir import RunDir
    from workbench.targets.backends.remote import read_remote

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
