"""``deploy``: runs in, one healthy endpoint out, recorded in the registry.

It reads the run's ``serve`` section for defaults, plans what to serve, refuses what cannot work
(serving Python without vLLM, head size, LoRA rank, endpoint name, port), writes the endpoint
folder, places files on the target, starts the guard there and waits for ``/health`` with
progress. An interrupted wait stops the half-started server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import warnings
from collections.abc import Sequence
from typing import Any

from workbench.errors import DeployError, EndpointNotFoundError
from workbench.serve.checks import (
    _max_lora_rank,
    check_head_size,
    check_port_free,
    check_reads_images,
)
from workbench.serve.endpoint import LIVE_STATES, Endpoint, endpoints_dir, refresh_state
from workbench.serve.identity import new_deployment
from workbench.serve.server import (
    PORT_FROM_GUARD,
    _url_host,
    free_port,
    guard_command,
    vllm_command,
    vllm_env,
)
from workbench.serve.sources import ServePlan, plan_serving
from workbench.serve.targets import _on_cpu, get_serve_target, probe_serving_python

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def deploy(source: Any, *more: Any, name: str | None = None, target: str = "local",
           merge: bool | None = None, python: str | None = None, host: str | None = None,
           port: int | None = None, api_key: str | None = None,
           max_lora_rank: int | None = None, max_model_len: int | None = None,
           keep: bool = False, wait: bool = True, timeout: float = 600.0, progress: bool = True,
           extra_args: Sequence[str] = (), registry: Any = None,
           plan: ServePlan | None = None) -> Endpoint:
    """Serve runs (Jobs, run ids/names, adapter or model folders, base ids) on one vLLM server.

        >>> ep = deploy(job)                          # base + the run's LoRA adapter  # doctest: +SKIP
        >>> ep = deploy(job_a, job_b)                 # several adapters, one base     # doctest: +SKIP
        >>> ep = deploy(job, merge=True)              # merged weights                 # doctest: +SKIP
        >>> ep = deploy(job, target="ssh:gpu")        # on an SSH host, via a tunnel   # doctest: +SKIP
        >>> ep = deploy(job, target="slurm:cluster")  # as a one-node Slurm job        # doctest: +SKIP

    ``target`` is ``local`` or a target from targets.yaml (see :mod:`workbench.serve.target`);
    adapters and model folders the target lacks are copied there. ``keep=False`` ties a local or
    SSH server to this process (a kernel restart stops it); ``keep=True`` lets it run until
    ``undeploy``; a Slurm endpoint always ends with its job. ``host`` defaults to loopback (on
    Slurm: every interface of the compute node); any other address generates an API key
    (``ep.api_key``) the server then requires. ``merge`` and ``max_model_len`` default to the
    run's ``serve`` section; ``extra_args`` go to vLLM as they are. ``plan`` serves a plan made
    elsewhere instead of planning ``source`` here (a course's, whose files the service copied).
    """
    if registry is None and os.environ.get("WORKBENCH_COURSE_URL"):  # a course hub's kernel:
        from workbench.course.client import deploy_via_course  # its service serves and bills

        options = {k: v for k, v in (("merge", merge), ("max_model_len", max_model_len))
                   if v is not None}
        return deploy_via_course(source, *more, name=name, **options)  # type: ignore[return-value]
    from workbench.runs.registry import Registry

    registry = registry or Registry()
    sources = [source, *more]
    spec_serve = _spec_serve(sources[0])
    if merge is None:
        merge = bool(getattr(spec_serve, "merge", False))
    if max_model_len is None:
        max_model_len = int(getattr(spec_serve, "max_model_len", 256))
    serve_target = get_serve_target(target)  # an unknown target fails before any work
    py = serve_target.python(python, getattr(spec_serve, "python", None))
    host = host or serve_target.default_host

    if plan is None:
        plan = plan_serving(sources, merge=merge)
    for note in plan.notes:
        warnings.warn(note, stacklevel=2)
    info = probe_serving_python(py, target)
    gpus = serve_target.gpus(plan.gpus)
    on_cpu = _on_cpu(info, None if gpus is None else gpus > 0)
    check_head_size(plan.model, on_cpu)
    check_reads_images(plan.model, py, info)
    lora_rank = _max_lora_rank(plan.adapters, max_lora_rank)
    name = name or plan.names[-1]
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,99}", name):
        raise DeployError(f"endpoint name {name!r} must be letters, digits, '.', '_' or '-' "
                          "(it names a folder and a server model); pass name=")
    existing = _existing(registry, name)
    if existing is not None:
        raise DeployError(f"endpoint {name!r} is already {existing.state} at {existing.url}; "
                          f"`workbench undeploy {name}` first, or pass name=")
    if target == "local":  # elsewhere the guard picks a free port on the server's machine
        if port is None:
            port = free_port(host)
        else:
            check_port_free(host, port)
    if host not in LOOPBACK and api_key is None:
        api_key = secrets.token_urlsafe(24)

    workdir = endpoints_dir() / name
    from workbench.serve.metering import hold_first_block, settle_start

    paid = hold_first_block(_run_spec(sources[0], plan.run_ids), name, workdir)
    ok = False
    try:
        endpoint = _start(serve_target, plan, registry, name, target, py, host, port, api_key,
                          max_model_len, lora_rank, on_cpu, extra_args, keep, gpus, workdir)
        if wait:
            try:
                endpoint.wait_healthy(timeout=timeout, progress=progress)
            except KeyboardInterrupt:  # an interrupted cell must not leave a half-started server
                endpoint.stop()
                raise
        ok = True
    finally:
        if paid is not None:  # the wallet's first block: charged if it failed, else metered
            settle_start(paid, ok)
    return endpoint


def _start(serve_target: Any, plan: Any, registry: Any, name: str, target: str, py: str,
           host: str, port: int | None, api_key: str | None, max_model_len: int,
           lora_rank: int | None, on_cpu: bool, extra_args: Sequence[str], keep: bool,
           gpus: int | None, workdir: Any) -> Endpoint:
    """Write the endpoint folder, start the guard on the target and register the endpoint."""
    import shutil

    from workbench.runs.registry import EndpointRecord

    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "cache").mkdir(parents=True)
    # Before anything else is written there: from here on the folder is this deployment's, and
    # handles of an earlier endpoint of the name leave it alone (workbench.serve.identity).
    deployment = new_deployment(workdir)
    (workdir / "tmp").mkdir()
    if api_key:
        key_file = workdir / "api_key"  # the guard hands it to vLLM in its environment
        key_file.touch(mode=0o600)
        key_file.write_text(api_key + "\n")
    plan = serve_target.place(plan, workdir)  # the paths the server reads
    sdir = serve_target.server_dir(workdir)
    command = vllm_command(py, plan, host, PORT_FROM_GUARD, max_model_len, lora_rank, on_cpu,
                           workdir, extra_args, server_dir=sdir)
    env = vllm_env(plan, sdir, on_cpu)
    (workdir / "command.json").write_text(json.dumps({"command": command, "env": env}, indent=1))
    serves = {"model": plan.model, "models": plan.names, "merged": plan.merged,
              "adapters": {a.name: str(a.path) for a in plan.adapters},
              "max_lora_rank": lora_rank, "runs": plan.run_ids, "python": py, "host": host,
              "keep": keep, "notes": plan.notes}
    watch = "" if keep or target.startswith("slurm:") else (
        f"--watch-pid {os.getpid()}" if target == "local" else "--watch-stdin")
    pid, server_pid = serve_target.start(
        guard_command(serve_target.guard_python, sdir, host, port or 0, watch, command,
                      gpus=0 if on_cpu or target != "local" else 1), env, workdir,
        0 if keep else os.getpid(), gpus=gpus or 0)
    now = time.time()
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    registry.delete_endpoint(name)  # a stopped endpoint of that name: its row is replaced
    registry.add_endpoint(EndpointRecord(
        name=name, target=target, url=f"http://{_url_host(url_host)}:{port}" if port else "",
        state="starting", pid=pid, server_pid=server_pid, endpoint_dir=str(workdir),
        serves=json.dumps(serves), created=now, updated=now, deployment=deployment))
    return Endpoint(registry.get_endpoint(name), registry)


def _run_spec(source: Any, run_ids: Sequence[str]) -> Any:
    """The spec of the (first) run served, which prices the endpoint; None when none is."""
    if hasattr(source, "spec"):
        try:
            return source.spec
        except Exception:
            return None
    if not run_ids:
        return None
    from workbench.runs.registry import Registry
    from workbench.runs.rundir import RunDir

    try:
        return RunDir(Registry().get_run(run_ids[0]).run_dir).spec()
    except Exception:  # not a run of this home (a folder): priced from the wallet's setting
        return None


def _spec_serve(source: Any) -> Any:
    """The run's ``serve`` section (merge, max_model_len, python), when the source is a run."""
    try:
        if hasattr(source, "spec"):
            return source.spec.serve
    except Exception:  # a run dir without a readable spec: the defaults serve
        return None
    return None


def _existing(registry: Any, name: str) -> Any:
    try:
        record = refresh_state(name, registry)
    except EndpointNotFoundError:
        return None
    return record if record.state in LIVE_STATES else None
