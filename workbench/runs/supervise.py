"""``python -m workbench.runs.supervise RUN_DIR``: start the ranks of one node and record how they ended.

The supervisor is the one process per run (per node) that outlives the notebook kernel: the local
backend starts it in a new session, so a kernel restart does not kill training. It starts the
node's launcher (:mod:`workbench.runs.launcher` on one node, torchrun across nodes), forwards a cancel
(SIGTERM) to every rank, kills stragglers, and writes the terminal state to status.json:
succeeded, failed (with the root cause a rank recorded) or cancelled. It records itself and the
launcher in status.json's ``processes`` (:mod:`workbench.runs.procs`); the launcher dies with it
(PR_SET_PDEATHSIG) and each rank watches it, so a supervisor killed -9 leaves nothing training.
Where the node sits and what it launches is :mod:`workbench.runs.node`; the error a failed
attempt records is :mod:`workbench.runs.failure`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

from workbench.errors import ResourceError
from workbench.runs import procs
from workbench.runs.budget import KILL_GRACE_S, AttemptBill
from workbench.runs.failure import error_file, error_text, launcher_killed, log_sizes
from workbench.runs.node import NodeRole, torchrun_command
from workbench.runs.rundir import (
    BUDGET_STOPPED,
    CANCEL_REQUESTED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    RunDir,
    cancelled_state,
)
from workbench.spec import RunSpec

if TYPE_CHECKING:
    from workbench.runs.standby import Ranks

OWN_FOLDER_ENV = "WORKBENCH_OWN_FOLDER"  # set for ranks whose run directory no other node shares
CANCEL_GRACE_S = 20.0  # SIGTERM first, SIGKILL after this long
MAX_RESTARTS = 3  # automatic resumes after a rank dies, each needing a newer snapshot


def _newest_committed_step(rd: RunDir) -> int | None:
    from workbench.runs.snapshots import MANIFEST, snapshots

    for folder in snapshots(rd):
        if (folder / MANIFEST).is_file():
            return int(folder.name.split("-", 1)[1])
    return None


def _fetch_from_storage(rd: RunDir, url: str | None, role: NodeRole) -> None:
    """Before the ranks start: fetch the newest snapshot from storage into a run directory
    without local snapshots, and always into a node's own folder (whose local snapshots are
    copies of older stored ones), so every node resumes from the same step."""
    from workbench.runs.snapshots import fetch_latest, newest_verified, storage_prefix

    if url and (role.own_folder and role.node_rank > 0 or newest_verified(rd) is None):
        got = fetch_latest(storage_prefix(url, rd.path.name), rd)
        print(f"supervisor: fetched {got.name if got else 'no snapshot'} from {url}", flush=True)


def publish_snapshot(run_dir: str) -> int:
    """Upload this run directory's newest verified snapshot to checkpoint.storage unless storage
    already names it latest: the backend does this on node 0 before nodes that do not share its
    folder fetch from storage."""
    from workbench.runs.snapshots import newest_verified, storage_prefix, stored_latest, upload

    rd = RunDir(run_dir)
    url, folder = rd.spec().checkpoint.storage, newest_verified(rd)
    if not url or folder is None:
        return 0
    prefix = storage_prefix(url, rd.path.name)
    if stored_latest(prefix) != folder.name:
        upload(folder, prefix)
        print(f"supervisor: uploaded {folder.name} to {url}", flush=True)
    return 0


def supervise(run_dir: str, role: NodeRole | None = None, standby: Ranks | None = None) -> int:
    """Run the attempt; ``role``: where this node sits (None: a single node); ``standby``: ranks
    already started and waiting for the go (their torchrun serves the first start, see
    :mod:`workbench.runs.standby`)."""
    role = role or NodeRole()
    rd = RunDir(run_dir)
    spec = rd.spec()
    cmd = torchrun_command(rd.path, spec.resources.procs_per_node, role)
    write = rd.write_status if role.writes_status else _node_log
    me = procs.ProcessIdentity.me("supervisor")
    cancel_at: list[float] = []
    child: list[subprocess.Popen] = []
    ranks: dict[int, psutil.Process] = {}  # every descendant of torchrun seen so far

    def on_signal(signum: int, frame: object) -> None:
        if not cancel_at:
            cancel_at.append(time.time())
            print(f"supervisor: signal {signum}, stopping the ranks", flush=True)
            if child:
                _signal_group(child[-1].pid, signal.SIGTERM)
                # Ranks run in sessions of their own: the group signal does not reach them.
                procs.kill_all(ranks.values(), signal.SIGTERM)

    # Before the start is recorded: a cancel that sees this supervisor signals it, and the
    # signal must stop the start, not kill the process before it records how the run ended.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # Still budget_stopped: nothing resumed it (job.resume() queues it first), so this is a
    # requeue or a rerun of the batch script. Its budget is spent, however little of the limit
    # the stop left unbilled: starting the ranks would only bill their start-up.
    stopped_before = rd.status().get("state") == BUDGET_STOPPED
    running = {"state": RUNNING, "supervisor_pid": os.getpid(), "host": socket.gethostname(),
               "command": cmd, "stop_reason": None, "note": None}
    if role.writes_status:
        procs.start_attempt(rd, me)  # unless the backend that started us recorded it already
        started = rd.start_unless_cancelled(**running)  # with the check: one locked write
    else:  # node 0 records the run's end; this node only must not start its ranks
        started = rd.status().get(CANCEL_REQUESTED) is None
        write(**running)
    if not started or cancel_at:  # a cancel came first: no ranks, nothing held, nothing billed
        print("supervisor: cancelled before the ranks started", flush=True)
        if role.writes_status:
            rd.update_status(_ended_on_request)
        return 0
    # The resources are held from now on: a CPU run's since the supervisor started, a standby's
    # cards from the go (its ranks waited on the CPU while launch planned and prepared the data).
    leased_at = time.time() if standby is not None and spec.resources.gpus_per_node else None
    bill = AttemptBill(rd, spec, role.writes_status, since=leased_at)
    try:
        gpus = _lease_gpus(rd, spec, me)
    except ResourceError as exc:  # other local runs hold the cards: nothing started, say who
        write(state=FAILED, ended=time.time(), exit_code=None, error=str(exc), **bill.close(),
              released=time.time())
        return 1
    if gpus is not None:
        from workbench.evaluate.beside import GPU_POOL_ENV
        from workbench.targets.leases import visible_devices

        # What eval.every_steps may lease a spare device from (workbench.evaluate.beside).
        os.environ[GPU_POOL_ENV] = ",".join(visible_devices())
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # torchrun and the ranks inherit it
        write(gpus=gpus)
    _fetch_from_storage(rd, spec.checkpoint.storage, role)
    restarts, resumed_from = 0, _newest_committed_step(rd)
    bill.stopped = stopped_before or bill.spent()  # spent already: no start-up, no step
    rc: int | None = None
    since = log_sizes(rd)
    while not bill.stopped and not cancel_at:  # a cancel before the (re)start starts nothing
        since = log_sizes(rd)
        rc = _run_ranks(rd, cmd, child, cancel_at, write, role, me, ranks, bill, standby)
        standby = None  # a restart starts torchrun afresh
        if cancel_at or rc == 0:
            break
        newest = _newest_committed_step(rd)
        progressed = newest is not None and (resumed_from is None or newest > resumed_from)
        if not progressed or restarts >= MAX_RESTARTS or role.own_folder:
            # A failure that repeats without progress is a bug, not a node dying. Nodes that
            # share no folder cannot agree on the snapshot to restart from: the run ends and
            # job.resume() starts every node from the one in checkpoint.storage.
            break
        restarts, resumed_from = restarts + 1, newest
        print(f"supervisor: ranks failed (exit {rc}); resuming from step-{newest} "
              f"(restart {restarts} of {MAX_RESTARTS})", flush=True)
        write(restarts=restarts, last_error=launcher_killed(rc) + error_text(
            rd, since=since, root_cause=error_file(rd, role)))
    if gpus is not None:  # every rank is gone: the cards are free for the next run
        from workbench.targets import leases

        leases.release(rd.path.name, me)
    final: dict[str, object] = {"ended": time.time(), "exit_code": rc}
    budget_stop = role.writes_status and rd.status().get("stop_reason") == "budget"
    if bill.stopped:
        final["state"] = BUDGET_STOPPED
    elif cancel_at:  # cancelled, or pruned when a sweep asked for the stop
        final["state"] = cancelled_state(rd.status()) if role.writes_status else "cancelled"
    elif rc == 0 and budget_stop:
        final["state"] = BUDGET_STOPPED
    elif rc == 0 and (rd.artefact_dir() is not None or not role.writes_status):
        final["state"] = SUCCEEDED
    else:
        final.update(state=FAILED, error=launcher_killed(rc) + error_text(
            rd, since=since, root_cause=error_file(rd, role)))
    # The outcome first, with the bill so far: a time limit (or a kill) that lands while the slow
    # bundle is written must not erase a recorded success. Then the bundle, and the final bill
    # (the bundle's time included) with ``released``: the resources are let go after this write,
    # and readers that want the bundle wait for it (Job.wait).
    write(**final, **bill.close())
    # An attempt that started no ranks (its budget was spent) keeps the last bundle: it ran nothing.
    done: dict[str, object] = {}
    if role.writes_status and (rc is not None or not (rd.path / "reproduce.zip").exists()):
        done.update(_bundle(rd, final))
    closing: dict[str, object] = {**done, **bill.close(), "released": time.time()}
    if role.writes_status:
        from workbench.plan.history import record_run

        try:  # planned against measured, in the same write: whoever waited for the end sees it
            closing["measured"] = record_run(rd, closing)
        except OSError as exc:
            print(f"supervisor: could not record the run's timing: {exc}", flush=True)
    write(**closing)
    return 0


def _ended_on_request(status: dict[str, object]) -> None:
    """A start refused on a cancel request: the run ends cancelled (or pruned) unless its end
    was recorded already (by the refusal itself, or by the cancel)."""
    if status.get("state") not in TERMINAL:
        status.update(state=cancelled_state(status), ended=time.time())


def _lease_gpus(rd: RunDir, spec: RunSpec, me: procs.ProcessIdentity) -> list[str] | None:
    """This run's CUDA devices, leased from those no other live local run holds
    (:mod:`workbench.targets.leases`); None for a CPU run, or under Slurm, which gives each job its own."""
    if spec.resources.gpus_per_node == 0 or os.environ.get("SLURM_JOB_ID"):
        return None
    from workbench.targets import leases

    return leases.acquire(rd.path.name, spec.resources.gpus_per_node, me)


def _run_ranks(rd: RunDir, cmd: list[str], child: list[subprocess.Popen],
               cancel_at: list[float], write: Callable[..., object], role: NodeRole,
               me: procs.ProcessIdentity, ranks: dict[int, psutil.Process],
               bill: AttemptBill, standby: Ranks | None = None) -> int:
    errors = error_file(rd, role)
    errors.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", procs.SUPERVISOR_ENV: me.token,
           "TORCHELASTIC_ERROR_FILE": str(errors)}
    if role.own_folder:  # only this node's ranks write into this folder (see train.snapshotting)
        env[OWN_FOLDER_ENV] = "1"
    if standby is not None:
        proc = standby.proc
        standby.go(rd, rd.logs_dir / role.launcher_log)
    else:
        with (rd.logs_dir / role.launcher_log).open("ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=rd.path,
                                    start_new_session=True, preexec_fn=procs.die_with_parent)
    child.append(proc)
    if cancel_at:  # the cancel came while torchrun was being started: on_signal missed it
        _signal_group(proc.pid, signal.SIGTERM)
    write(launcher_pid=proc.pid)
    if role.writes_status:
        procs.record(rd, procs.ProcessIdentity.of(proc.pid, "launcher"))
    while True:
        try:
            rc = proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            _note_descendants(proc.pid, ranks)
            if bill.tick() and not cancel_at:  # the ranks did not stop in time for the budget
                cancel_at.append(time.time() - CANCEL_GRACE_S + KILL_GRACE_S)
                _signal_group(proc.pid, signal.SIGTERM)
            if cancel_at and time.time() - cancel_at[0] > CANCEL_GRACE_S:
                _signal_group(proc.pid, signal.SIGKILL)
                procs.kill_all(ranks.values())
    _signal_group(proc.pid, signal.SIGKILL)
    procs.kill_all(ranks.values())  # ranks that outlived torchrun (they run in their own sessions)
    if standby is not None:
        standby.ended(errors)
    if role.writes_status:
        for ident in procs.of_attempt(rd.status()):
            if ident.role == "rank" and ident.here:
                ident.signal(signal.SIGKILL)
    return rc


def _note_descendants(pid: int, ranks: dict[int, psutil.Process]) -> None:
    try:
        for p in psutil.Process(pid).children(recursive=True):
            ranks.setdefault(p.pid, p)  # the first seen keeps its create time: reuse-safe
    except psutil.NoSuchProcess:
        pass


def _bundle(rd: RunDir, final: dict[str, object]) -> dict[str, object]:
    try:
        from workbench.runs.reproduce import write_bundle

        return {"bundle": write_bundle(rd, final).name}
    except Exception as exc:  # the run's outcome stands even if the bundle cannot be written
        return {"bundle_error": str(exc)}


def _node_log(**fields: object) -> None:
    # Nodes other than 0 report to their own log (the supervisor's stdout), not status.json.
    print("supervisor:", json.dumps(fields, default=str), flush=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.runs.supervise")
    ap.add_argument("run_dir")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 (multi-node runs)")
    ap.add_argument("--rdzv-id")
    ap.add_argument("--own-folder", action="store_true",
                    help="this node does not share node 0's run directory")
    ap.add_argument("--publish-snapshot", action="store_true",
                    help="upload the newest snapshot to checkpoint.storage and exit")
    a = ap.parse_args(argv)
    if a.publish_snapshot:
        return publish_snapshot(a.run_dir)
    if a.nnodes > 1 and not a.rdzv_endpoint:
        ap.error("--rdzv-endpoint is required with --nnodes > 1")
    return supervise(a.run_dir, NodeRole(a.nnodes, a.node_rank, a.rdzv_endpoint, a.rdzv_id,
                                         a.own_folder))


if __name__ == "__main__":
    sys.exit(main())
