"""The Slurm backend: a generated sbatch script running srun + torchrun, one supervisor per node.

``submit`` writes RUN_DIR/slurm.sbatch (also printed, so the user sees what is submitted; the
target's secret ``env`` goes to a 0600 file beside the run directory that the script sources),
copies the run directory to the cluster when the target has a ``workdir`` (or a ``login`` host),
and submits it with ``sbatch`` here, or over SSH on the login node. The script asks for the
nodes, GPUs per node (``--gres``), CPUs, memory, time, partition/account/qos and ``--requeue``,
picks the rendezvous on the first node (``scontrol show hostnames``) and runs one
``python -m workbench.runs.supervise`` per node via ``srun``, with the node rank from SLURM_NODEID.
A requeued job starts the same script again; training resumes from RUN_DIR/checkpoints/latest.
Before anything of a run is made, ``check_resources`` refuses a request that no node of the
partition can hold (:mod:`workbench.targets.backends.slurm_check`), which sbatch may accept and
leave queued forever.

``status`` is status.json corrected by the scheduler (``scontrol show job``; ``sacct`` once the
job has left slurmctld's memory, where accounting exists): pending/requeued -> queued, TIMEOUT ->
failed with the limit and how to raise it, CANCELLED -> cancelled, a vanished job -> failed.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from workbench.runs.rundir import (
    BUDGET_STOPPED,
    CANCELLED,
    FAILED,
    PRUNED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    RunDir,
    cancelled_state,
)
from workbench.spec import RunSpec
from workbench.targets.backends.remote import (
    MAX_CHUNK,
    LocalTransport,
    MirroredRunDir,
    SSHTransport,
    Transport,
    is_mirrored,
    load_placement,
    put_dir,
    read_remote,
    save_placement,
    send_stop_request,
    shell_path,
    sync_run_dir,
    unconfirmed_cancel,
    write_remote_status,
)
from workbench.targets.backends.slurm_check import (
    check_cluster,
    check_request,
    explain_sbatch,
    read_partitions,
)
from workbench.targets.backends.slurm_script import (  # noqa: F401  (re-exported)
    ACTIVE,
    SLURM_FAILED,
    WAITING,
    allocation_lines,
    parse_scontrol,
    sbatch_script,
)
from workbench.targets.check import TargetReport, register_check
from workbench.targets.named import SlurmTarget, TargetError, get_target
from workbench.targets.secrets import env_file_path, remote_quote, scrub, secret_values, write_secret_env


class SlurmBackend:
    name = "slurm"

    def __init__(self, ref: str, target: SlurmTarget | None = None,
                 chunk: int = MAX_CHUNK) -> None:
        self.ref = ref
        self._target = target
        self.chunk = chunk  # bytes per file per sync round trip

    @property
    def target(self) -> SlurmTarget:
        if self._target is None:
            t = get_target(self.ref)
            if not isinstance(t, SlurmTarget):
                raise TargetError(f"{self.ref} is not a slurm target")
            self._target = t
        return self._target

    @property
    def transport(self) -> Transport:
        t = self.target
        return SSHTransport(t.login, t) if t.login else LocalTransport()

    def _cluster_dir(self, run_dir: Path) -> str | None:
        """Where the run lives on the cluster; None: in place (the notebook is on the login node)."""
        t = self.target
        workdir = t.workdir or ("~/workbench-runs" if t.login else None)
        return f"{workdir.rstrip('/')}/{Path(run_dir).name}" if workdir else None

    def scheduler(self, command: str, timeout: float = 60.0) -> Any:
        # Without the secret env: sbatch would pass it on to the job from its own environment,
        # and a failing command's text would show it. The job script sources it from its file.
        return self.transport.run(f"{self.target.shell_prefix()}{command}",
                                  check=False, timeout=timeout)

    def shells(self, spec: RunSpec) -> list[tuple[Transport, str]]:
        """The login node's shell (or this machine's) with the target's set-up and plain env:
        the compute nodes see the cluster's shared filesystem as it does
        (workbench.targets.remote_model). No secrets: they would cost a round trip and are not needed."""
        return [(self.transport, self.target.shell_prefix())]

    def preview(self, spec: RunSpec, run_dir: Path) -> str:
        """The sbatch script ``submit`` would write for ``spec`` in ``run_dir``."""
        where = self._cluster_dir(run_dir) or str(Path(run_dir).resolve())
        return sbatch_script(spec, self.target, where, f"wb-{Path(run_dir).name}")

    def check_resources(self, spec: RunSpec) -> None:
        """Refuse (ResourceError) a run no node of the target's partition can ever hold, before
        anything of it is made: sbatch would accept some such jobs and leave them queued."""
        check_request(spec, self.target, read_partitions(self.scheduler))

    # -- submit ----------------------------------------------------------------------------------
    def submit(self, run_dir: Path, spec: RunSpec) -> str:
        rd, mirror = RunDir(run_dir), MirroredRunDir(run_dir)
        cluster_dir = self._cluster_dir(run_dir)
        if cluster_dir and cluster_dir.startswith("~"):
            # #SBATCH lines are not expanded by a shell: the script needs the absolute path.
            try:
                res = self.transport.run('printf %s "$HOME"', timeout=60)
            except TargetError as exc:
                raise self._refuse(mirror, str(exc)) from None
            cluster_dir = res.stdout.decode().strip() + cluster_dir[1:]
        where = cluster_dir or str(rd.path.resolve())
        script = sbatch_script(spec, self.target, where, f"wb-{rd.path.name}")
        (rd.path / "slurm.sbatch").write_text(script, encoding="utf-8")
        print(f"sbatch script for {rd.path.name} ({rd.path / 'slurm.sbatch'}):\n"
              f"{self._scrub(script)}", flush=True)
        rd.write_status(state=QUEUED, submitted=time.time(), target=self.ref)
        # A resumed run is submitted again into the same run directory: start a fresh record.
        save_placement(rd.path, target=self.ref, kind="slurm", dir=cluster_dir, job=None,
                       final=False, artefact_fetched=False, secret_env_removed=False)
        try:
            if cluster_dir:
                put_dir(self.transport, rd.path, cluster_dir.rsplit("/", 1)[0], run_dir=True)
                # What the new attempt needs, without replacing what only the cluster's copy
                # knows (time billed so far, metrics and logs of earlier attempts).
                write_remote_status(self.transport, cluster_dir, self.target.python, rd.path,
                                    state=QUEUED, submitted=rd.status().get("submitted"),
                                    target=self.ref, error=None, stop_reason=None, note=None,
                                    ended=None, warning=None)
            write_secret_env(self.transport, self.target.env, where)
            res = self.scheduler(f"sbatch --parsable {shell_path(where)}/slurm.sbatch")
        except TargetError as exc:
            raise self._refuse(mirror, str(exc)) from None
        job = res.stdout.decode(errors="replace").strip().split(";")[0]
        if res.returncode != 0 or not job.isdigit():
            raise self._refuse(mirror, self.explain_sbatch(res.text))
        save_placement(rd.path, job=job)
        return f"slurm:{job}"

    def explain_sbatch(self, err: str) -> str:
        """sbatch's refusal ``err`` with what to set (:func:`slurm_check.explain_sbatch`)."""
        return explain_sbatch(err, self.target, self.transport.where, self.scheduler)

    def _scrub(self, text: str) -> str:
        """``text`` without the target's secrets (nor any token-shaped string)."""
        return scrub(text, secret_values(self.target.env))

    def _refuse(self, mirror: MirroredRunDir, message: str) -> TargetError:
        message = self._scrub(message)
        mirror.finish(state=FAILED, ended=time.time(), error=message)
        return TargetError(message)

    # -- status ----------------------------------------------------------------------------------
    def _sync(self, run_dir: Path, complete: bool = False) -> None:
        cluster_dir = MirroredRunDir(run_dir).placement.get("dir")
        if cluster_dir:
            sync_run_dir(self.transport, cluster_dir, Path(run_dir), python=self.target.python,
                         chunk=self.chunk, complete=complete)

    def sync(self, run_dir: Path) -> None:
        """Bring new status, metrics and log bytes into the local run directory (best effort)."""
        mirror = MirroredRunDir(run_dir)
        if mirror.placement.get("dir") and not mirror.final:
            try:
                self._sync(run_dir)
            except TargetError:
                pass  # the login node may come back; status() reports why it is stale

    def job_info(self, job: str) -> dict[str, str]:
        """What the scheduler knows about ``job`` ({} when it has forgotten it)."""
        res = self.scheduler(f"scontrol show job -o {job}")
        if res.returncode == 0 and "JobState=" in res.stdout.decode(errors="replace"):
            return parse_scontrol(res.stdout.decode(errors="replace").splitlines()[0])
        if "invalid job id" not in res.text.lower():
            # A busy or restarting slurmctld (timeouts) says nothing about the job: never
            # conclude from that that it vanished.
            raise TargetError(f"could not ask Slurm about job {job}: {res.text or 'no answer'}")
        # slurmctld forgets finished jobs after MinJobAge; the accounting database does not.
        res = self.scheduler(f"sacct -n -P -X -j {job} -o State,ExitCode,Timelimit")
        line = res.stdout.decode(errors="replace").strip().splitlines()
        if res.returncode == 0 and line:
            state, exit_code, limit = (line[0].split("|") + ["", "", ""])[:3]
            return {"JobState": state.split()[0], "ExitCode": exit_code, "TimeLimit": limit,
                    "source": "sacct"}
        return {}

    def status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        out = self._status(run_dir, job_id)
        if MirroredRunDir(run_dir).final:
            self._remove_secret_env(run_dir)
        return out

    def _remove_secret_env(self, run_dir: Path) -> None:
        """The job's secret env file goes once the outcome is final (completed, failed, cancelled,
        budget-stopped: Slurm will not requeue it). Until then a requeued attempt still sources
        it; a resume submits again and writes it again."""
        placement = load_placement(run_dir)
        if placement.get("secret_env_removed"):
            return
        where = placement.get("dir") or str(Path(run_dir).resolve())
        try:
            res = self.transport.run(f"rm -f {remote_quote(env_file_path(where))}", check=False,
                                     timeout=60)
        except TargetError:
            return  # the login node may come back: the next status() tries again
        if res.returncode == 0:
            save_placement(run_dir, secret_env_removed=True)

    def _status(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        rd, mirror = RunDir(run_dir), MirroredRunDir(run_dir)
        job = mirror.placement.get("job")
        if mirror.final or not job:
            return rd.status()
        try:
            self._sync(run_dir)
            info = self.job_info(job)
        except TargetError as exc:
            return {**rd.status(), "warning": str(exc)}
        state = info.get("JobState", "")
        if state not in WAITING and state not in ACTIVE:
            # The job is over: bring back every remaining byte (and an outcome recorded after
            # our first sync) before anything is frozen.
            try:
                self._sync(run_dir, complete=True)
            except TargetError as exc:
                return {**rd.status(), "warning": str(exc)}
        status = rd.status()
        extra = {"slurm_state": state or "unknown", "requeues": int(info.get("Restarts", 0) or 0)}
        if info.get("NodeList") and info["NodeList"] != "(null)":
            extra["nodes"] = info["NodeList"]
        if state in WAITING:
            reason = info.get("Reason", "")
            return {**status, **extra, "state": QUEUED,
                    "queue_reason": reason if reason not in ("", "None") else None}
        if state in ACTIVE:
            if status.get("state") in TERMINAL and state == "RUNNING" and \
                    status.get("ended", 0) < _slurm_time(info.get("StartTime")):
                # status.json is the previous attempt's ending (a requeue): this one is starting.
                return {**status, **extra, "state": RUNNING}
            if status.get("state") not in TERMINAL or status.get("state") in (CANCELLED, PRUNED):
                # A supervisor stopped by Slurm (requeue, time limit, scancel) writes
                # "cancelled" (or "pruned", asked for with the scancel); what that means is
                # Slurm's to say once the job leaves RUNNING.
                status = {**status, "state": RUNNING}
            return {**status, **extra}
        if status.get("state") in (SUCCEEDED, BUDGET_STOPPED) and state not in ACTIVE:
            # The run recorded how it ended before Slurm stopped the job (a time limit or a
            # scancel that landed while the bundle was written): that outcome stands.
            return self._finish_recorded(mirror, status, extra)
        if state == "TIMEOUT":
            limit = info.get("TimeLimit", self.target.time)
            return mirror.finish(**extra, state=FAILED, ended=time.time(), error=(
                f"Slurm stopped job {job} at its time limit ({limit}); raise 'time:' of "
                f"{self.ref} in targets.yaml (or set train.max_steps lower), and set "
                "checkpoint.every_steps so a rerun resumes instead of starting over"))
        if state == "CANCELLED":  # "pruned" when the scancel came with a sweep's prune request
            # (status.json holds "ended": null while the run has not recorded an end)
            return mirror.finish(**extra, state=cancelled_state(status),
                                 ended=status.get("ended") or time.time())
        if state == "COMPLETED" and status.get("state") in TERMINAL:
            return self._finish_recorded(mirror, status, extra)
        if state in SLURM_FAILED or state == "COMPLETED":
            if status.get("state") == FAILED and status.get("error"):
                return mirror.finish(**extra)  # the supervisor's rank traceback says more
            return mirror.finish(**extra, state=FAILED, ended=time.time(), error=(
                f"Slurm job {job} ended {state or 'without a state'} (exit "
                f"{info.get('ExitCode', '?')}) before the run recorded an outcome; "
                f"logs/slurm-{job}.out:\n{self._out_tail(rd, job)}"))
        if not state:
            if status.get("state") in TERMINAL:
                return mirror.finish(**extra)
            return mirror.finish(**extra, state=FAILED, ended=time.time(), error=(
                f"Slurm no longer knows job {job} and the run recorded no outcome (the job "
                f"vanished: purged, or the cluster was reset); logs/slurm-{job}.out:\n"
                f"{self._out_tail(rd, job)}"))
        return {**status, **extra}

    def _finish_recorded(self, mirror: MirroredRunDir, status: dict[str, Any],
                         extra: dict[str, Any]) -> dict[str, Any]:
        if status["state"] == SUCCEEDED and mirror.placement.get("dir"):
            try:
                mirror.fetch_artefact(self.transport, mirror.placement["dir"])
            except TargetError as exc:
                return {**status, "warning": f"could not copy the artefact back yet: {exc}"}
        return mirror.finish(**extra)

    def _out_tail(self, rd: RunDir, job: str, lines: int = 20) -> str:
        path = rd.logs_dir / f"slurm-{job}.out"
        cluster_dir = MirroredRunDir(rd.path).placement.get("dir")
        if not cluster_dir and not path.is_file():
            return "(no output)"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return self._scrub("\n".join(text.strip().splitlines()[-lines:])) or "(no output)"

    # -- cancel ----------------------------------------------------------------------------------
    def cancel(self, run_dir: Path, job_id: str | None, timeout: float = 30.0,
               stop_request: str | None = None) -> None:
        """scancel the job and wait until Slurm confirms it left the queue; the outcome is then
        what :meth:`status` says (a success or budget stop recorded before the cancel stands).
        An unconfirmed cancel raises and records nothing: the run may still be training."""
        mirror = MirroredRunDir(run_dir)
        job = mirror.placement.get("job")
        if mirror.final or not job:
            return
        if stop_request:  # where the job's supervisor reads it, before scancel stops it
            cluster_dir = mirror.placement.get("dir")
            if cluster_dir:
                send_stop_request(self.transport, cluster_dir, self.target.python, mirror.path,
                                  stop_request, f"Slurm job {job}")
            else:  # the run directory is used in place
                RunDir(run_dir).write_status(stop_request=stop_request)
        # With a request, first a signal alone (no kill): the job's supervisor stops its ranks,
        # records the outcome and closes its bill, and the job ends by itself. A plain scancel
        # kills it KillWait seconds later, which can cut that short and leave the bill open.
        ended = (stop_request and self._scancel_until_gone(job, "--signal=TERM ", timeout)) or \
            self._scancel_until_gone(job, "", timeout) or \
            self._scancel_until_gone(job, "--signal=KILL --full ", 15.0)
        if not ended:
            raise unconfirmed_cancel(run_dir, f"Slurm job {job}", self.transport.where)
        self.status(run_dir, job_id)

    def _scancel_until_gone(self, job: str, options: str, timeout: float) -> bool:
        deadline = time.time() + timeout
        with contextlib.suppress(TargetError):  # unreachable login node: confirmed below or not
            self.scheduler(f"scancel {options}{job}")
        while True:
            try:
                if self.job_info(job).get("JobState", "CANCELLED") not in WAITING | ACTIVE:
                    return True
            except TargetError:
                pass  # slurmctld busy or the login node unreachable: ask again
            if time.time() >= deadline:
                return False
            time.sleep(0.5)

    # -- reading ---------------------------------------------------------------------------------
    def read(self, run_dir: Path, path: str, offset: int = 0) -> bytes:
        mirror = MirroredRunDir(run_dir)
        cluster_dir = mirror.placement.get("dir")
        if cluster_dir and not is_mirrored(path) and not mirror.final:
            return read_remote(self.transport, cluster_dir, path, offset, self.target.python)
        self.sync(run_dir)
        return mirror.read_local(path, offset)

    def logs(self, run_dir: Path) -> dict[str, str]:
        self.sync(run_dir)
        return MirroredRunDir(run_dir).log_texts()


def _slurm_time(value: str | None) -> float:
    try:
        return time.mktime(time.strptime(value or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0


def check_slurm_target(target: SlurmTarget, report: TargetReport) -> None:
    check_cluster(SlurmBackend(target.ref, target), report)


register_check("slurm", check_slurm_target)
