"""What a target saw of one kernel session: whether the kernel still runs, when it started and ended.

:func:`observe` takes a session's record (:mod:`workbench.targets.kernels.ledger`) and asks the target
itself, with no provisioner, tunnel or client involved, so a bill can be settled after the client
that kept it is gone:

- Slurm: the allocation's ``Start``/``End``/``State`` from Slurm's accounting (``sacct``), or from
  ``scontrol show job`` where accounting is off (slurmctld keeps an ended job for ``MinJobAge``);
  a job neither knows any more leaves the kernel's own ``ended.json`` (on the shared filesystem);
- SSH: the kernel process's start as the host recorded it (its identity) and, once it no longer
  runs, the end it wrote in ``ended.json`` when it exited (see :mod:`workbench.targets.kernels.heartbeat`).

The answer is ``{"alive": bool, "started": epoch|None, "ended": epoch|None, "how": str}``;
``ended`` is None where the target kept no record of the end. A target that cannot be reached
raises :class:`~workbench.errors.TargetError` (or RemoteKernelError).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from workbench.errors import RemoteKernelError, TargetError
from workbench.targets.backends.remote import LocalTransport, SSHTransport, Transport
from workbench.targets.kernels.heartbeat import ENDED_FILE
from workbench.targets.kernels.placement import SEP, SSHPlacement, slurm_epoch
from workbench.targets.named import SlurmTarget, SSHTarget, get_target


def observe(session: dict[str, Any]) -> dict[str, Any]:
    target = get_target(session["target"])
    if isinstance(target, SlurmTarget):
        return _slurm(target, session)
    assert isinstance(target, SSHTarget)
    return _ssh(target, session)


def _ssh(target: SSHTarget, session: dict[str, Any]) -> dict[str, Any]:
    identity = session.get("identity")
    if not identity or not session.get("dir"):
        raise RemoteKernelError(f"kernel session {session['kernel_id']} recorded no process "
                                "identity: nothing on the host can be asked about it")
    placement = SSHPlacement(target, SSHTransport(target.hosts[0], target), session["kernel_id"])
    placement.identity, placement.dir = identity, session["dir"]
    out = placement.watch()
    started = float(identity["create_time"])
    if out["alive"]:
        return {"alive": True, "started": started, "ended": None, "how": "the kernel still runs"}
    ended = (out.get("ended") or {}).get("ended")
    return {"alive": False, "started": started, "ended": float(ended) if ended else None,
            "how": f"the kernel process ended on {placement.transport.where}"
                   + (" (its ended.json)" if ended else " without recording when")}


def _slurm(target: SlurmTarget, session: dict[str, Any]) -> dict[str, Any]:
    from workbench.targets.backends.slurm_script import ACTIVE, WAITING, parse_scontrol

    job = str(session.get("job") or "")
    if not job.isdigit():
        raise RemoteKernelError(f"kernel session {session['kernel_id']} recorded no Slurm job")
    transport: Transport = SSHTransport(target.login, target) if target.login else LocalTransport()
    ended_json = shlex.quote(f"{session.get('dir') or '.'}/{ENDED_FILE}")
    # shell_prefix sets -e: every command here may fail (sacct without accounting, a forgotten job).
    res = transport.run(f"{target.shell_prefix()}sacct -X -n -P -j {job} -o State,Start,End "
                        f"2>/dev/null || true; echo {SEP}; scontrol show job -o {job} 2>&1 || true;"
                        f" echo {SEP}; cat {ended_json} 2>/dev/null || true", check=False,
                        timeout=60)
    acct, ctl, own = (res.stdout.decode(errors="replace").split(SEP) + ["", ""])[:3]
    rows = [ln.split("|") for ln in acct.splitlines() if ln.count("|") >= 2]
    if rows:
        state, start, end = rows[0][:3]
        how = "Slurm's accounting (sacct)"
    elif "JobState=" in ctl:
        info = parse_scontrol(ctl.strip().splitlines()[0])
        state, start, end = (info.get(k) or "" for k in ("JobState", "StartTime", "EndTime"))
        how = "slurmctld (scontrol)"
    elif "invalid job id" in ctl.lower():  # Slurm forgot the job and keeps no accounting
        try:
            ended = float(json.loads(own)["ended"])
        except (ValueError, KeyError, TypeError):
            ended = None
        return {"alive": False, "started": None, "ended": ended,
                "how": f"Slurm no longer knows job {job}; the kernel's own record"}
    else:
        raise TargetError(f"could not ask Slurm about job {job}: {res.text.strip()[-500:]}")
    state = (state.split() or ["?"])[0]
    alive = state in WAITING | ACTIVE
    return {"alive": alive, "started": slurm_epoch(start) or None,
            "ended": None if alive else slurm_epoch(end) or None,
            "how": f"{how}: job {job} {state}"}
