"""The course's worker: one request of the course service, run as the student it is for.

The service starts it through sudo (:mod:`workbench.course.students`)::

    sudo -n -u NAME -- PYTHON -I -m workbench.course.worker    # a JSON request on stdin

and reads one JSON answer from the last line of its stdout (``{"error", "message"}`` when the
request was refused). The request names the student's space, which must be the worker's own:
the worker runs the ordinary library there (WORKBENCH_HOME inside it, files group-readable for
the service, no GPU unless the request's environment gives one), so a student's spec, data,
model folder and reward code are read and run with the student's rights only.

Requests: ``quote`` (plan a spec: cost, hours), ``launch`` (a priced spec), ``spec`` (a run's
spec and what it billed itself), ``resume`` (a run, changes), ``cancel`` (a run), ``evaluate``
(a run, tasks, max_samples, max_new_tokens, limit_s: the ``workbench eval`` table on stdout
before the answer), ``export`` (a run, formats, quant, limit_s: its export into the run's
folder), ``serve_plan`` (runs, or adapter folders: what an endpoint of them would
serve, read with the student's rights), ``serve`` (runs, name, api_key, max_model_len, python: an
endpoint of them started on this machine, its vLLM run as the student; answers its guard's
identity at once, the service waits for it to answer), ``unserve`` (name, why, procs: that
endpoint stopped, and every process the service recorded for it ended), ``sweep`` (a priced
spec, its space, sweep()'s options: the sweep started, its controller's identity, which the
service meters from then on), ``sweep_resume`` and ``sweep_cancel`` (a sweep), ``whoami``.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import sys
from pathlib import Path
from typing import Any


def _home(space: Path) -> Path:
    return space / "workbench"


def _job_answer(job: Any) -> dict[str, Any]:
    """A run and the process that holds its attempt (the service meters it from there on)."""
    import psutil

    rid = job.record.backend_job_id or ""
    pid = int(rid.split(":", 1)[1]) if rid.startswith("local:") else None
    ctime = psutil.Process(pid).create_time() if pid else None
    return {"run": job.id, "run_dir": str(job.run_dir.path), "pid": pid, "create_time": ctime}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    verb = request.get("verb")
    if verb == "whoami":
        return {"user": pwd.getpwuid(os.geteuid()).pw_name, "home": os.environ["WORKBENCH_HOME"]}
    if verb == "quote":
        from workbench.plan import plan
        from workbench.spec import RunSpec

        result = plan(RunSpec.parse(request["spec"]))
        return {"cost": result.cost, "hours": result.hours, "fits": result.fits}
    if verb == "launch":
        from workbench.runs.launching import launch
        from workbench.runs.registry import Registry
        from workbench.spec import RunSpec

        return _job_answer(launch(RunSpec.parse(request["spec"]), registry=Registry()))
    if verb == "serve_plan":
        from workbench.course.serving import plan_to_data
        from workbench.runs.jobs import get_job
        from workbench.serve.sources import plan_serving

        sources = [Path(s) if s.startswith("/") else get_job(s) for s in map(str, request["runs"])]
        return {"plan": plan_to_data(plan_serving(sources))}
    if verb in ("sweep", "sweep_resume", "sweep_cancel"):
        return _sweep(verb, request)
    if verb == "serve":
        return _serve(request)
    if verb == "unserve":
        return _unserve(request)
    from workbench.runs.jobs import get_job

    job = get_job(str(request["run"]))
    if verb == "spec":
        return {"spec": job.spec.model_dump(mode="json"),
                "spent": float(job.status().get("cost") or 0.0)}
    if verb == "resume":
        admitted = request.get("spec")
        if admitted is not None and job.spec.model_dump(mode="json") != admitted:
            # spec.yaml is the student's file: what resumes is what the service admitted.
            return {"error": "CourseError",
                    "message": f"run {job.id}'s spec.yaml changed after the course admitted it; "
                               "resume again (the course checks the spec as it is then)"}
        return _job_answer(job.resume(**request.get("changes", {})))
    if verb == "cancel":
        return {"state": job.cancel()}
    if verb == "export":
        from workbench.serve.export_run import export

        signal.alarm(int(request.get("limit_s") or 0))  # ends itself at the course's limit
        report = export(job, [str(f) for f in request.get("formats") or ["merged"]],
                        quant=[str(q) for q in request.get("quant") or ["f16"]], progress=False)
        return {"run": job.id, "folders": {k: str(v) for k, v in report.folders.items()},
                "checks": report.checks}
    if verb == "evaluate":
        from workbench.cli import main as cli

        signal.alarm(int(request.get("limit_s") or 0))  # ends itself at the course's limit

        argv = ["eval", job.id]
        if request.get("tasks"):
            argv += ["--tasks", ",".join(request["tasks"])]
        for key in ("max_samples", "max_new_tokens"):
            if request.get(key) is not None:
                argv += [f"--{key.replace('_', '-')}", str(int(request[key]))]
        rc = cli(argv)
        sys.stdout.flush()
        if rc:
            return {"error": "EvaluationError", "message": f"workbench eval exited {rc}"}
        return {"run": job.id}
    return {"error": "BadRequest", "message": f"unknown request {verb!r}"}


def _sweep(verb: str, request: dict[str, Any]) -> dict[str, Any]:
    """Start, resume or cancel a sweep. A started controller is named (pid, start time) from this
    process's own children, not from the sweep's files, which the student can write."""
    import psutil

    from workbench.spec import RunSpec
    from workbench.sweep.handle import get_sweep
    from workbench.sweep.start import sweep

    before = {c.pid for c in psutil.Process().children()}
    if verb == "sweep":
        s = sweep(RunSpec.parse(request["spec"]), space=request["sweep_space"],
                  **request.get("options", {}))
    else:
        s = get_sweep(str(request["sweep"]))
        if verb == "sweep_cancel":
            return {"sweep": s.id, "state": s.cancel(timeout=float(request.get("wait_s", 30)))}
        from workbench.sweep.space import parse_space

        data, admitted = s.data(), request.get("admitted") or {}
        spec = RunSpec.parse(admitted.get("spec") or {})
        space = {p.path: p.to_dict() for p in parse_space(admitted.get("space"), spec)}
        if data["spec"] != spec.model_dump(mode="json") or data["space"] != space:
            return {"error": "CourseError",
                    "message": f"sweep {s.id}'s sweep.json changed after the course admitted it; "
                               "it is not resumed (start a new sweep)"}
        s = s.resume()
    started = [(c.pid, c.create_time()) for c in psutil.Process().children()
               if c.pid not in before]
    return {"sweep": s.id, "record": str(s.record.path), "state": s.state,
            "controller": list(started[0]) if started else None}


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    import psutil

    from workbench.runs.jobs import get_job
    from workbench.serve import deploy

    options = {k: request[k] for k in ("max_model_len", "python") if request.get(k) is not None}
    ep = deploy(*[get_job(str(r)) for r in request["runs"]], name=str(request["name"]),
                keep=True, wait=False, progress=False, api_key=str(request["api_key"]), **options)
    pid = int(ep.record.pid)
    return {"endpoint_dir": str(ep.dir), "url": ep.record.url,
            "guard": [pid, psutil.Process(pid).create_time()]}


def _unserve(request: dict[str, Any]) -> dict[str, Any]:
    """Stop the endpoint as the student would, then end what is left of the processes the service
    recorded for it (the student may have moved or renamed the folder that names them)."""
    import time

    import psutil

    from workbench.errors import WorkbenchError
    from workbench.serve.endpoint import STOP_FILE, get_endpoint

    log = ""
    try:
        ep = get_endpoint(str(request["name"]))
        (ep.dir / STOP_FILE).write_text(json.dumps({"reason": request.get("why"),
                                                    "time": time.time()}))
        ep.stop(timeout=30)
        log = ep.logs(tail=15)
    except (WorkbenchError, OSError):
        pass
    left = []
    for pid, started in request.get("procs") or []:
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(started)) <= 0.05:
                left.append(p)
        except psutil.Error:
            continue
    for end, grace in (("terminate", 10.0), ("kill", 5.0)):
        for p in left:
            try:
                getattr(p, end)()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(left, timeout=grace)
    return {"stopped": not left, "log": log}


def main() -> int:
    request = json.loads(sys.stdin.read() or "{}")
    if os.geteuid() == 0:
        print(json.dumps({"error": "CourseError",
                          "message": "the course worker runs as a student, never as root"}))
        return 2
    space = Path(str(request.get("space", "")))
    if not space.is_dir() or space.stat().st_uid != os.geteuid():
        print(json.dumps({"error": "CourseError", "message": f"{space} is not this user's space"}))
        return 2
    os.umask(0o027)  # the service's group reads what the student's work writes
    os.chdir(space)
    os.environ.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
    os.environ["WORKBENCH_HOME"] = str(_home(space))
    os.environ.pop("WORKBENCH_COURSE_URL", None)  # the work itself is plain single-user work
    from workbench.errors import WorkbenchError

    try:
        answer = handle(request)
    except WorkbenchError as exc:
        answer = {"error": getattr(exc, "kind", type(exc).__name__), "message": str(exc)}
    except PermissionError as exc:  # a link to what the student may not read, followed as them
        answer = {"error": "CourseError",
                  "message": f"{exc.filename} cannot be read by you ({exc.strerror})"}
    print(json.dumps(answer), flush=True)
    return 3 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
