"""The remote calibration probe: a target that is not this machine, measured on the target itself.

:func:`probe_target` runs ``python -m workbench.plan.probe --emit`` where the target's runs
run (over SSH on an SSH target's first host; as a one-task ``srun`` job in a Slurm target's
partition, with its account, QoS and the CPUs and GPU a run's process gets), reads the figures
it prints and stores them as the target's calibration (``WORKBENCH_HOME/calibration/TARGET.json``
with ``source: "target probe"`` and ``where``: the host, or the Slurm job and node). The planner
then plans that target from them (:func:`workbench.plan.calibrate.time_basis`) and says so
("calibrated by a probe on slurm:gpu (Slurm job 42 on node7) DATE", and how steady its readings
were). The probe measures for a few seconds, as :func:`workbench.plan.calibrate.measure_here`
does here (each figure the median of several readings, their spread kept); ``workbench targets
check ssh:NAME|slurm:NAME`` runs it once the target is ready, and the stored figures are used
until the next probe. A check reuses a stored probe rather than
measuring again: on an SSH target while the first host's device (CPU model and core count, or
GPU name and count, which the check sees anyway) is the one measured, however old; on a Slurm
target, whose compute nodes the check does not see, when it is less than an hour old.

The first launch on a remote target that has no calibration measures it too
(:class:`LaunchProbe`): the probe runs in a thread while the launch plans, checks and prepares
its data, and the launch waits for it at most ``LAUNCH_PROBE_TIMEOUT_S`` before it re-plans the
clock from it ("measured on HOST now"). A probe that fails or times out never fails the launch:
its plan keeps the table and says why (``clock.calibration.probe_error``).
"""

from __future__ import annotations

import json
import os
import shlex
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from workbench.plan.calibrate import (
    PROBE_TAG,
    Calibration,
    CalibrationError,
    CalibrationWarning,
    store,
)

# A probe that waits longer than this (a busy Slurm queue, a hung host) is given up; the planner
# keeps using what it had (an earlier probe, else the GPU table).
PROBE_TIMEOUT_S = 600.0
# `targets check` run again within this reuses the last probe rather than queueing another job.
PROBE_REUSE_S = 3600.0
# A first launch waits at most this for its target's probe (it has been running meanwhile).
LAUNCH_PROBE_TIMEOUT_S = 90.0
# "0": launches never probe (`targets check` still does); the test suite's remote targets are
# all this one machine, so its launches leave the measuring to the tests about it.
LAUNCH_PROBE_ENV = "WORKBENCH_LAUNCH_PROBE"
_SLURM_PROBE_MINUTES = 5  # --time of the probe job: it measures for seconds


def probe_command(target: Any) -> str:
    """The shell command that measures ``target`` on the target and prints the figures."""
    cmd = (f"{shlex.quote(target.python)} -m workbench.plan.probe --emit --target "
           f"{shlex.quote(target.ref)}")
    if target.kind == "ssh":
        return cmd
    opts = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={target.cpus_per_task or 2}",
            f"--time={_SLURM_PROBE_MINUTES}", "--job-name=wb-calibrate"]
    opts += [f"--{k}={v}" for k, v in (("partition", target.partition),
                                       ("account", target.account), ("qos", target.qos)) if v]
    if int(target.defaults.get("resources.gpus_per_node") or 0) > 0:
        opts.append("--gres=gpu:1")  # a run's card, not the login node's CPU
    return f"srun {' '.join(shlex.quote(o) for o in opts)} {cmd}"


def probe_target(ref: str, *, timeout: float = PROBE_TIMEOUT_S, reuse_s: float = 0.0,
                 device: dict[str, Any] | None = None) -> Calibration:
    """Measure the target ``ref`` (``ssh:NAME`` or ``slurm:NAME``) on the target, store the
    figures as its calibration and return them. ``device``: the device (``kind``, ``name``,
    ``cores``) just seen where the probe runs; a stored probe of that same device is returned,
    however old (hardware that has not changed measures the same), and one of another device is
    measured again at once. Without it, ``reuse_s``: a probe of this target stored less than
    that many seconds ago is returned instead of queueing another. Raises CalibrationError,
    saying what to fix, when the probe cannot run there (nothing is stored then: an earlier
    calibration stays)."""
    from workbench.errors import TargetError
    from workbench.plan.calibrate import calibration_file, load_calibration
    from workbench.targets.named import get_target

    path = calibration_file(ref)
    earlier = load_calibration(ref, quiet=True) if path.is_file() else None
    if earlier is not None and earlier.source == "target probe":
        if device is not None:
            if {k: earlier.device.get(k) for k in ("kind", "name", "cores")} == {
                    k: device.get(k) for k in ("kind", "name", "cores")}:
                return earlier
        elif reuse_s > 0 and time.time() - path.stat().st_mtime < reuse_s:
            return earlier

    target = get_target(ref)
    cmd = target.shell_prefix() + probe_command(target)
    try:
        if target.kind == "ssh":
            from workbench.targets.backends.remote import SSHTransport

            where = f"host {target.hosts[0].host}"
            res = SSHTransport(target.hosts[0], target).run(cmd, check=False, timeout=timeout)
        else:
            from workbench.targets.backends.remote import LocalTransport, SSHTransport

            where = f"a Slurm job in partition {target.partition or '(default)'}"
            transport = SSHTransport(target.login, target) if target.login else LocalTransport()
            res = transport.run(cmd, check=False, timeout=timeout)
    except TargetError as exc:
        raise CalibrationError(f"the calibration probe could not reach {ref}: {exc}") from None
    line = next((ln for ln in res.stdout.decode(errors="replace").splitlines()
                 if ln.startswith(PROBE_TAG)), None)
    if res.returncode != 0 or line is None:
        err = (res.stderr.decode(errors="replace").strip() or res.stdout.decode(
            errors="replace").strip() or "no output")[-800:]
        raise CalibrationError(
            f"the calibration probe failed on {where} of {ref} (exit {res.returncode}): {err}\n"
            f"-> `workbench targets check {ref}` lists what is missing; the planner uses the "
            "GPU table (or the target's earlier calibration) meanwhile")
    try:
        raw = json.loads(line[len(PROBE_TAG):])
        cal = Calibration(**raw)
    except (ValueError, TypeError) as exc:
        raise CalibrationError(f"the calibration probe on {ref} printed figures this version "
                               f"cannot read ({exc}): install the same workbench version on the "
                               "target") from None
    cal.target, cal.source = ref, "target probe"
    store(cal)
    return cal


class LaunchProbe:
    """The probe a launch runs on its remote target when the target has no calibration."""

    def __init__(self, ref: str, timeout: float) -> None:
        self.ref, self.timeout = ref, timeout
        self.cal: Calibration | None = None
        self.error: str | None = None
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"calibrate {ref}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.cal = probe_target(self.ref, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - a probe never fails the launch: it is reported
            self.error = str(exc)

    @classmethod
    def start(cls, spec: Any, timeout: float = LAUNCH_PROBE_TIMEOUT_S) -> LaunchProbe | None:
        """Start measuring ``spec.target`` when it is remote and has no stored calibration (a
        stored one of another device is not used by the planner, and not replaced here either:
        ``targets check`` measures again); None when there is nothing to measure."""
        from workbench.plan.calibrate import calibration_file

        if spec.target == "local" or os.environ.get(LAUNCH_PROBE_ENV, "1") == "0" or \
                calibration_file(spec.target).is_file():
            return None
        return cls(spec.target, timeout)

    def settle(self, plan_file: Path, spec: Any, on_target: Any = None) -> None:
        """Wait for the probe (what is left of its timeout) and rewrite the launch's plan: its
        clock from the new calibration, or the table's with the probe's failure said."""
        self._thread.join(max(0.0, self.timeout + 5.0 - (time.monotonic() - self._started)))
        old = json.loads(plan_file.read_text(encoding="utf-8"))
        if self.cal is None:
            why = self.error or (f"no answer within {self.timeout:.0f} s (it goes on; run "
                                 f"`workbench targets check {self.ref}` later)")
            warnings.warn(f"the calibration probe of {self.ref} failed: {why}; this run is "
                          "planned from the GPU table", CalibrationWarning, stacklevel=2)
            note = (f"calibration probe of {self.ref} at this launch failed ({why.splitlines()[0]}"
                    f"): time from the GPU table; `workbench targets check {self.ref}` measures "
                    "again")
            old["assumptions"] = [*old.get("assumptions", []), note]
            if old.get("clock"):
                old["clock"]["calibration"] = {**old["clock"].get("calibration", {}),
                                               "probe_error": why}
                old["clock"]["basis"] = f"{old['clock'].get('basis', '')}; {note}"
            _write(plan_file, old)
            return
        from workbench.plan.planner import plan
        from workbench.targets.remote_model import planned_from

        # Re-planned as launch planned it: every row measured when launch re-planned for that.
        every_row = any("every training row" in a for a in old.get("assumptions", []))
        try:
            with planned_from(on_target) if on_target is not None else nullcontext():
                new = plan(spec, longest=old.get("memory_seq_len") if every_row else None
                           ).to_dict()
        except Exception as exc:  # noqa: BLE001 - the plan accepted stands; the next one uses it
            warnings.warn(f"{self.ref} was calibrated, but re-planning from it failed ({exc}): "
                          "this run keeps its plan", CalibrationWarning, stacklevel=2)
            return
        was = f"calibrated by a probe on {self.ref}" + (f" ({self.cal.where})" if self.cal.where
                                                          else "") + f" {self.cal.date}"
        now = f"calibrated by a probe on {self.ref}, measured on {self.cal.where or self.ref} now"
        new["assumptions"] = [a.replace(was, now) for a in new.get("assumptions", [])]
        if new.get("clock"):
            new["clock"]["basis"] = new["clock"].get("basis", "").replace(was, now)
            new["clock"]["calibration"] = {**new["clock"]["calibration"], "measured_now": True}
        if "data_tokens" in old:
            new["data_tokens"] = old["data_tokens"]
        _write(plan_file, new)


def _write(path: Path, data: dict[str, Any]) -> None:
    from workbench.runs.rundir import write_json_atomic

    write_json_atomic(path, data)


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.plan.probe --emit --target REF``: measure this machine (its first
    GPU when torch sees one) and print the calibration on one line for the probe that started it
    here; nothing is stored on this machine."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.plan.probe")
    ap.add_argument("--emit", action="store_true", required=True)
    ap.add_argument("--target", default="local")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    dtype = args.dtype
    if dtype == "auto":
        from workbench.spec.precision import local_device_kind, resolve_precision

        dtype = resolve_precision("auto", "lora",
                                  local_device_kind() if on_gpu else "cpu").compute_dtype
    from workbench.plan.calibrate import measure_here

    cal = measure_here(args.target, on_gpu, dtype)
    print(PROBE_TAG + json.dumps(cal.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
