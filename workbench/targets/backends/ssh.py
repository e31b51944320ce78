"""The SSH backend: torchrun on one or more hosts, meeting at a static rendezvous on node 0.

``submit`` checks every host's Python environment (the remote error text becomes the error),
checks whether the hosts share node 0's working directory (a marker file written there), copies
the prepared run directory into each host's working directory, and starts
``python -m workbench.runs.supervise RUN_DIR --nnodes N --node-rank R --rdzv-endpoint HOST0:PORT``
detached on each host (``setsid nohup``), node 0 first. Global rank 0 runs on node 0, so the run
directory of record lives on the first host; the local run directory mirrors its status,
metrics and logs (other nodes' logs come back as ``logs/node-R-NAME``). Hosts that share no
folder need ``checkpoint.storage``: every node then resumes from the snapshot stored there. The
job id is ``ssh:HOST0:PID0``; remote.json in the local run directory holds every node's host,
folder and supervisor PID.
"""

from __future__ import annotations

import shlex
import time
import uuid
from pathlib import Path
from typing import Any

from workbench.runs.rundir import FAILED, QUEUED, SUCCEEDED, TERMINAL, RunDir, cancelled_state
from workbench.spec import RunSpec
from workbench.targets.backends.remote import (
    MAX_CHUNK,
    MirroredRunDir,
    SSHTransport,
    is_mirrored,
    put_dir,
    read_remote,
    save_placement,
    send_stop_request,
    shell_path,
    sync_run_dir,
    unconfirmed_cancel,
    write_remote_status,
)
from workbench.targets.check import (
    TargetReport,
    check_reachable,
    probe_environment,
    register_check,
)
from workbench.targets.named import SSHTarget, TargetError, get_target

# Imports the supervisor's dependencies and picks a free port for the rendezvous, in one call.
PREFLIGHT = ("import socket, workbench.runs.supervise, torch; s = socket.socket(); "
             "s.bind(('', 0)); print('WORKBENCH-PORT', s.getsockname()[1]); "
             "print('WORKBENCH-GPUS', torch.cuda.device_count())")


class SSHBackend:
    name = "ssh"

    def __init__(self, ref: str, target: SSHTarget | None = None,
                 chunk: int = MAX_CHUNK) -> None:
        self.ref = ref
        self._target = target
        self.chunk = chunk  # bytes per file per sync round trip

    @property
    def target(self) -> SSHTarget:
        if self._target is None:
            t = get_target(self.ref)
            if not isinstance(t, SSHTarget):
                raise TargetError(f"{self.ref} is not an ssh target")
            self._target = t
        return self._target

    def _transport(self, host: Any) -> SSHTransport:
        return SSHTransport(host, self.target)

    def _workdir(self, host: Any) -> str:
        return host.workdir or self.target.workdir

    def shells(self, spec: RunSpec) -> list[tuple[SSHTransport, str]]:
        """(transport, shell prefix with the target's set-up and plain env) per host ``spec``
        runs on: a short command there sees the files the run's processes will
        (workbench.targets.remote_model). No secrets: they would cost a round trip and are not needed."""
        return [(self._transport(h), self.target.shell_prefix())
                for h in self.target.hosts[:spec.resources.nodes]]

    # -- submit ----------------------------------------------------------------------------------
    def submit(self, run_dir: Path, spec: RunSpec) -> str:
        t, rd, mirror = self.target, RunDir(run_dir), MirroredRunDir(run_dir)
        nnodes = spec.resources.nodes
        if nnodes > len(t.hosts):
            raise self._refuse(mirror, f"resources.nodes is {nnodes} but {t.ref} lists "
                                       f"{len(t.hosts)} host(s); add hosts to {t.ref} in "
                                       "targets.yaml or lower resources.nodes")
        hosts = t.hosts[:nnodes]
        transports = [self._transport(h) for h in hosts]
        port = None
        prefixes: list[str] = []  # per host: set-up and env, secrets from an owner-only file
        for i, tr in enumerate(transports):
            try:
                prefixes.append(t.remote_shell_prefix(
                    tr, f"{self._workdir(hosts[i]).rstrip('/')}/{rd.path.name}"))
                res = tr.run(f"{prefixes[i]}{shlex.quote(t.python)} -c "
                             f"{shlex.quote(PREFLIGHT)}", check=False, timeout=120)
            except TargetError as exc:
                raise self._refuse(mirror, str(exc)) from None
            found = [ln for ln in res.stdout.decode(errors="replace").splitlines()
                     if ln.startswith("WORKBENCH-PORT ")]
            if res.returncode != 0 or not found:
                raise self._refuse(mirror, (
                    f"the Python environment of {t.ref} is broken on {tr.where}: {t.python} "
                    f"could not import workbench and torch:\n{res.text[-1500:]}\n-> fix "
                    f"'python:', 'setup:' or 'env:' of {t.ref}; `workbench targets check {t.ref}` "
                    "lists what is missing"))
            if i == 0:
                port = t.rdzv_port or int(found[0].split()[1])
            cards = [int(ln.split()[1]) for ln in res.stdout.decode(errors="replace").splitlines()
                     if ln.startswith("WORKBENCH-GPUS ")]
            if cards and spec.resources.gpus_per_node > cards[0]:
                # Refused here, not by the supervisor's lease on the host once the run "started".
                raise self._refuse(mirror, (
                    f"resources.gpus_per_node is {spec.resources.gpus_per_node} but "
                    f"{tr.where} has {cards[0]} GPU(s) that torch can use; lower "
                    f"resources.gpus_per_node (0 trains on CPU) or pick a target with more"))
        master = transports[0].resolved_hostname()
        dirs = [f"{self._workdir(h).rstrip('/')}/{rd.path.name}" for h in hosts]
        try:
            shared = self._shared_with_node0(transports, hosts, rd.path.name)
        except TargetError as exc:
            raise self._refuse(mirror, str(exc)) from None
        if not all(shared) and not spec.checkpoint.storage:
            apart = ", ".join(h.host for h, ok in zip(hosts, shared) if not ok)
            raise self._refuse(mirror, (
                f"{apart} do(es) not share a folder with {hosts[0].host} (a file written into "
                f"{self._workdir(hosts[0])} there is not seen in {t.ref}'s workdir on the other "
                "host), so a resume could not start every node from the same snapshot\n-> set "
                "checkpoint.storage (a folder every host reaches, or s3://...), or give the "
                f"hosts of {t.ref} a shared workdir"))
        fields = {"state": QUEUED, "submitted": time.time(), "target": t.ref,
                  "nodes": [h.host for h in hosts]}
        rd.write_status(**fields)
        try:
            for tr, h in zip(transports, hosts):
                put_dir(tr, rd.path, self._workdir(h), run_dir=True)
            # What the new attempt needs, without replacing what only the remote copy knows.
            write_remote_status(transports[0], dirs[0], t.python, rd.path, **fields, error=None,
                                stop_reason=None, note=None, ended=None, warning=None)
            if not all(shared):
                self._publish_snapshot(transports[0], dirs[0], prefixes[0])
        except TargetError as exc:
            raise self._refuse(mirror, f"could not copy the run directory: {exc}") from None
        nodes: list[dict[str, Any]] = []
        # A resumed run is submitted again into the same run directory: start a fresh record.
        save_placement(rd.path, target=t.ref, kind="ssh", rdzv=f"{master}:{port}", nodes=nodes,
                       final=False, artefact_fetched=False, shared=shared)
        try:
            for rank, (tr, h, d, prefix) in enumerate(zip(transports, hosts, dirs, prefixes)):
                # Node 0 too, when any node is apart: it must not restart on its own then.
                own = not shared[rank] or (rank == 0 and not all(shared))
                pid = self._start_node(tr, d, prefix, rank, nnodes, f"{master}:{port}",
                                       rd.path.name, own)
                nodes.append({"host": h.host, "dir": d, "pid": pid, "rank": rank})
                save_placement(rd.path, nodes=nodes)
        except TargetError as exc:
            self._kill_nodes(nodes, hard=True)
            raise self._refuse(mirror, f"could not start node {len(nodes)}: {exc}") from None
        return f"ssh:{hosts[0].host}:{nodes[0]['pid']}"

    def _shared_with_node0(self, transports: list[SSHTransport], hosts: list[Any],
                           run_id: str) -> list[bool]:
        """Per node: does its workdir show a file just written into node 0's? (node 0: True)"""
        if len(hosts) == 1:
            return [True]
        token = uuid.uuid4().hex
        name = f".workbench-shared-{run_id}"
        marker = [f"{shell_path(self._workdir(h).rstrip('/'))}/{shlex.quote(name)}" for h in hosts]
        transports[0].run(f"mkdir -p {shell_path(self._workdir(hosts[0]))} && "
                          f"printf %s {token} > {marker[0]}", timeout=60)
        try:
            seen = [tr.run(f"cat {m} 2>/dev/null; true", timeout=60).stdout.decode().strip()
                    for tr, m in zip(transports[1:], marker[1:])]
        finally:
            transports[0].run(f"rm -f {marker[0]}", check=False, timeout=60)
        return [True] + [s == token for s in seen]

    def _publish_snapshot(self, tr: SSHTransport, d: str, prefix: str) -> None:
        # Nodes without node 0's folder start from storage: first make sure storage holds node
        # 0's newest snapshot (its upload may have been cut short when the run stopped).
        t, q = self.target, shell_path(d)
        res = tr.run(f"{prefix}cd {q}; {shlex.quote(t.python)} -m workbench.runs.supervise "
                     f"{q} --publish-snapshot", check=False, timeout=3600)
        if res.returncode != 0:
            raise TargetError(f"could not upload the newest snapshot to checkpoint.storage from "
                              f"{tr.where}, so the nodes could not resume from the same step:\n"
                              f"{res.text[-1500:]}")

    def _start_node(self, tr: SSHTransport, d: str, prefix: str, rank: int, nnodes: int,
                    rdzv: str, run_id: str, own_folder: bool) -> int:
        t, q = self.target, shell_path(d)
        # Only the supervisor goes to the background (not the whole command list), so $! is
        # its PID and ssh returns at once: its output is the log, not this session.
        cmd = (f"{prefix}cd {q}; PYTHONUNBUFFERED=1 setsid nohup "
               f"{shlex.quote(t.python)} -m workbench.runs.supervise {q} --nnodes {nnodes} "
               f"--node-rank {rank} --rdzv-endpoint {shlex.quote(rdzv)} --rdzv-id "
               f"{shlex.quote(run_id)}{' --own-folder' if own_folder else ''} "
               f">> {q}/logs/supervisor.log 2>&1 < /dev/null & echo $!")
        out = tr.run(cmd, timeout=60).stdout.decode().strip().splitlines()
        if not out or not out[-1].isdigit():
            raise TargetError(f"the supervisor did not start on {tr.where} (no PID)")
        return int(out[-1])

    def _refuse(self, mirror: MirroredRunDir, message: str) -> TargetError:
        # The run was registered before submit: leave it failed with the reason, not pending.
        mirror.finish(state=FAILED, ended=time.time(), error=message)
        return TargetError(message)

    # -- status ----------------------------------------------------------------------------------
    def _sync(self, run_dir: Path, complete: bool = False) -> dict[str, bool]:
        """Sync every node; which supervisors are alive, by node rank ("0", "1", ...)."""
        placement = MirroredRunDir(run_dir).placement
        alive: dict[str, bool] = {}
        for node in placement.get("nodes", []):
            host = self.target.hosts[node["rank"]]
            rank = node["rank"]
            found = sync_run_dir(self._transport(host), node["dir"], Path(run_dir),
                                 python=self.target.python,
                                 prefix="" if rank == 0 else f"node-{rank}-", pids=[node["pid"]],
                                 chunk=self.chunk, complete=complete)
            alive[str(rank)] = any(found.values())
        return alive

    def sync(self, run_dir: Path) -> None:
        """Bring new status, metrics and log bytes into the local run directory (best effort)."""
        if not MirroredRunDir(run_dir).final:
            self._sync_quiet(run_dir)

    def status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        rd, mirror = RunDir(run_dir), MirroredRunDir(run_dir)
        if mirror.final or not mirror.placement.get("nodes"):
            return rd.status()
        try:
            alive = self._sync(run_dir)
        except TargetError as exc:
            # The host may come back; report what we last knew and why it is stale.
            return _stale(rd, exc)
        status = rd.status()
        if status.get("state") in TERMINAL:
            return self._finish(mirror, status, alive)
        if alive.get("0"):
            return status
        try:  # the supervisor writes its terminal state just before exiting: look once more
            self._sync(run_dir, complete=True)
        except TargetError as exc:
            return _stale(rd, exc)
        status = rd.status()
        if status.get("state") in TERMINAL:
            return self._finish(mirror, status, {})
        log = mirror.read_local("logs/supervisor.log", 0).decode(errors="replace").strip()
        tail = "\n".join(log.splitlines()[-15:])
        node0 = mirror.placement["nodes"][0]
        return mirror.finish(
            state=FAILED, ended=time.time(),
            error=(f"the supervisor on {node0['host']} exited without recording an outcome "
                   f"(killed, or the host restarted); logs/supervisor.log:\n{tail}"))

    def _finish(self, mirror: MirroredRunDir, status: dict[str, Any],
                alive: dict[str, bool]) -> dict[str, Any]:
        """Freeze the mirror once the outcome is recorded, node 0's supervisor has exited (it
        writes the reproduce bundle after the outcome) and every byte has come back."""
        if status.get("state") == SUCCEEDED:
            node0 = mirror.placement["nodes"][0]
            try:
                mirror.fetch_artefact(self._transport(self.target.hosts[0]), node0["dir"])
            except TargetError as exc:
                return {**status, "warning": f"could not copy the artefact back yet: {exc}"}
        if alive.get("0"):
            return status  # the outcome is known; the bundle and the last log lines follow
        try:
            self._sync(mirror.path, complete=True)
        except TargetError as exc:
            return _stale(RunDir(mirror.path), exc)
        return mirror.finish(**{k: v for k, v in RunDir(mirror.path).status().items()
                                if k != "updated"})

    # -- cancel ----------------------------------------------------------------------------------
    def cancel(self, run_dir: Path, job_id: str | None, timeout: float = 30.0,
               stop_request: str | None = None) -> None:
        """SIGTERM every node's supervisor (SIGKILL after ``timeout``) and record the end once
        every supervisor is seen gone. An unconfirmed cancel raises and records nothing."""
        rd, mirror = RunDir(run_dir), MirroredRunDir(run_dir)
        if mirror.final or rd.status().get("state") in TERMINAL:
            return
        nodes = mirror.placement.get("nodes", [])
        if stop_request and nodes:  # node 0's supervisor writes the run's outcome
            send_stop_request(self._transport(self.target.hosts[nodes[0]["rank"]]),
                              nodes[0]["dir"], self.target.python, rd.path, stop_request,
                              f"the supervisors of {rd.path.name}")
        self._kill_nodes(nodes, hard=False)
        if not self._wait_gone(run_dir, len(nodes), timeout):
            self._kill_nodes(nodes, hard=True)
            if not self._wait_gone(run_dir, len(nodes), 15.0):
                raise unconfirmed_cancel(run_dir, f"the supervisors of {rd.path.name}",
                                         ", ".join(n["host"] for n in nodes))
        status = rd.status()
        if status.get("state") in TERMINAL:
            self._finish(mirror, status, {})
        else:  # every supervisor is gone, stopped on this request: cancelled (or pruned)
            mirror.finish(state=cancelled_state(status), ended=time.time())

    def _wait_gone(self, run_dir: Path, nnodes: int, timeout: float) -> bool:
        """True once a complete sync saw every node's supervisor gone (never on a failed sync)."""
        deadline = time.time() + timeout
        while True:
            try:
                alive = self._sync(run_dir)
                if len(alive) == nnodes and not any(alive.values()):
                    self._sync(run_dir, complete=True)
                    return True
            except TargetError:
                pass  # unreachable: nothing is known about the ranks there
            if time.time() >= deadline:
                return False
            time.sleep(0.5)

    def _sync_quiet(self, run_dir: Path) -> dict[str, bool]:
        try:
            return self._sync(run_dir)
        except TargetError:
            return {}

    def _kill_nodes(self, nodes: list[dict[str, Any]], hard: bool) -> None:
        # SIGTERM lets each supervisor stop its ranks and record "cancelled"; SIGKILL also takes
        # the launcher's process group (the ranks), which the supervisor started in its own session.
        for node in reversed(nodes):
            pid = int(node["pid"])
            if hard:
                cmd = (f"pg=$(ps -o pgid= -p $(pgrep -P {pid} | head -1) 2>/dev/null | tr -d ' '); "
                       f"kill -KILL {pid} 2>/dev/null; [ -n \"$pg\" ] && kill -KILL -- -$pg "
                       "2>/dev/null; true")
            else:
                cmd = f"kill -TERM {pid} 2>/dev/null; true"
            try:
                self._transport(self.target.hosts[node["rank"]]).run(cmd, check=False)
            except TargetError:
                pass

    # -- reading ---------------------------------------------------------------------------------
    def read(self, run_dir: Path, path: str, offset: int = 0) -> bytes:
        mirror = MirroredRunDir(run_dir)
        if is_mirrored(path) or mirror.final:
            if not mirror.final:
                self._sync_quiet(run_dir)
            return mirror.read_local(path, offset)
        node0 = mirror.placement["nodes"][0]
        return read_remote(self._transport(self.target.hosts[0]), node0["dir"], path, offset,
                           self.target.python)

    def logs(self, run_dir: Path) -> dict[str, str]:
        mirror = MirroredRunDir(run_dir)
        if not mirror.final and mirror.placement.get("nodes"):
            self._sync_quiet(run_dir)
        return mirror.log_texts()


def check_ssh_target(target: SSHTarget, report: TargetReport) -> None:
    gpus = target.defaults.get("resources.gpus_per_node")
    for host in target.hosts:
        tr = SSHTransport(host, target)
        if not check_reachable(tr, host.host, host.destination, target.connect_timeout, report):
            continue
        probe_environment(tr, target, host.workdir or target.workdir, report, host.host, gpus)


def _stale(rd: RunDir, exc: TargetError) -> dict[str, Any]:
    """What we last knew, and why it may be out of date (the host may come back)."""
    status = rd.status()
    earlier = status.get("warning")
    return {**status, "warning": f"{earlier}\n{exc}" if earlier else str(exc)}


register_check("ssh", check_ssh_target)
