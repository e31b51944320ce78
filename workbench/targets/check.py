"""Checking a target before anything runs there: ``check_target(name)`` probes reachability, the
Python environment, torch, GPUs, free disk (and Slurm, the partition) and returns a
:class:`TargetReport` that says precisely what is missing and how to fix it
(``workbench targets check NAME`` prints it). Each backend registers how to check its kind.
"""

from __future__ import annotations

import importlib
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench.runs.home import home
from workbench.targets.named import (
    HostSpec,
    SSHTarget,
    Target,
    TargetError,
    get_target,
    target_problems,
    targets_file,
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class TargetReport:
    """The outcome of ``check_target``: one line per check, and what to do about each failure."""

    target: str
    checks: list[Check] = field(default_factory=list)
    # What each checked machine trains on ({"kind", "name", "cores"}, as a calibration records
    # it), by the place the checks name: `targets check` reuses a calibration of the same device.
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def missing(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        self.checks.append(Check(name, ok, detail, "" if ok else fix))
        return ok

    def __str__(self) -> str:
        lines = [f"target {self.target}: {'ready' if self.ok else 'NOT READY'}"]
        for c in self.checks:
            lines.append(f"  [{'ok' if c.ok else 'MISSING'}] {c.name}: {c.detail}")
            if c.fix:
                lines.append(f"        -> {c.fix}")
        return "\n".join(lines)

    __repr__ = __str__  # the CLI prints results with repr()

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{'✅' if c.ok else '❌'}</td><td>{html.escape(c.name)}</td>"
            f"<td style='text-align:left'>{html.escape(c.detail)}"
            f"{'<br><i>' + html.escape(c.fix) + '</i>' if c.fix else ''}</td></tr>"
            for c in self.checks)
        return f"<b>{html.escape(self.target)}</b><table>{rows}</table>"


# Runs on the target with the target's Python; prints one JSON object. Kept free of workbench
# imports at top level so a missing package is reported, not a crash.
PROBE = r"""
import importlib.metadata, importlib.util, json, os, shutil, subprocess, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
# Finding the packages is enough for most; importing transformers and peft would take longer
# than everything else here. torch is imported, for its CUDA view.
for mod in ("workbench", "transformers", "peft"):
    if importlib.util.find_spec(mod) is None:
        out[mod], out[mod + "_error"] = None, f"No module named {mod!r}"
        continue
    try:
        out[mod] = importlib.metadata.version(mod)
    except importlib.metadata.PackageNotFoundError:
        out[mod] = "installed"
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if out["cuda_devices"]:  # the device a calibration here measures (its first card)
        out["device"] = {"kind": "gpu", "name": torch.cuda.get_device_name(0),
                         "cores": out["cuda_devices"]}
except Exception as exc:
    out["torch"], out["torch_error"] = None, f"{type(exc).__name__}: {exc}"
try:  # what `workbench targets setup` recorded when it made this environment
    with open(os.path.join(sys.prefix, ".workbench-setup.json")) as fh:
        out["setup"] = json.load(fh)
except (OSError, ValueError):
    pass
if "device" not in out:
    cpu = ""
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                    if l.startswith("model name")), "")
    except OSError:
        pass
    import platform
    out["device"] = {"kind": "cpu", "name": cpu or platform.processor() or platform.machine(),
                     "cores": os.cpu_count() or 1}
smi = shutil.which("nvidia-smi")
out["nvidia_smi"] = None
if smi:
    r = subprocess.run([smi, "-L"], capture_output=True, text=True)
    out["nvidia_smi"] = (r.stdout or r.stderr).strip()
wd = os.path.expanduser(sys.argv[1])
try:
    os.makedirs(wd, exist_ok=True)
    probe = os.path.join(wd, ".workbench-write-test")
    open(probe, "w").close(); os.remove(probe)
    out["workdir_writable"] = True
except OSError as exc:
    out["workdir_writable"] = False
    out["workdir_error"] = str(exc)
d = wd
while not os.path.isdir(d):
    d = os.path.dirname(d) or "/"
out["workdir"] = wd
out["disk_free_gb"] = round(shutil.disk_usage(d).free / 2**30, 1)
print("WORKBENCH-PROBE " + json.dumps(out))
"""

MIN_FREE_DISK_GB = 5.0


def check_reachable(transport: Any, label: str, destination: str, connect_timeout: float,
                    report: TargetReport) -> bool:
    """Report whether ``transport`` logs in (``reachable (LABEL)``); whether it did."""
    try:
        transport.run("true", timeout=connect_timeout + 20)
    except TargetError as exc:
        report.add(f"reachable ({label})", False, str(exc).split("\n-> ")[0],
                   str(exc).split("\n-> ")[-1])
        return False
    report.add(f"reachable ({label})", True, f"ssh {destination} works")
    return True


def probe_environment(transport: Any, target: Target, workdir: str, report: TargetReport,
                      where: str, gpus_expected: int | None = None) -> dict[str, Any] | None:
    """Run PROBE on ``transport`` with the target's Python; add findings to ``report``."""
    prefix = target.remote_shell_prefix(transport, f"{workdir.rstrip('/')}/.probe")
    cmd = f"{prefix}{shlex.quote(target.python)} - {shlex.quote(workdir)}"
    res = transport.run(cmd, input=PROBE.encode(), check=False, timeout=120)
    line = next((ln for ln in res.stdout.decode(errors="replace").splitlines()
                 if ln.startswith("WORKBENCH-PROBE ")), None)
    if res.returncode != 0 or line is None:
        err = (res.stderr.decode(errors="replace").strip() or "no output")[-800:]
        report.add(f"python ({where})", False, f"{target.python} failed: {err}",
                   f"set 'python:' of {target.ref} to an interpreter that exists on {where}, "
                   "and check its 'setup:' lines")
        return None
    info: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    if isinstance(info.get("device"), dict):
        report.devices[where] = info["device"]
    report.add(f"python ({where})", True, f"{info['executable']} (Python {info['python']})")
    for mod in ("workbench", "torch", "transformers", "peft"):
        report.add(f"{mod} ({where})", bool(info.get(mod)),
                   info.get(mod) or info.get(mod + "_error", "not importable"),
                   f"install it into {target.python}: {target.python} -m pip install "
                   f"{'-e /path/to/workbench' if mod == 'workbench' else mod}")
    if info.get("workbench") and info.get("torch"):
        check_versions(info, target, report, where)
    if info.get("torch"):
        gpus = info.get("cuda_devices", 0)
        smi = info.get("nvidia_smi")
        detail = f"torch sees {gpus} CUDA device(s)" + (f"; nvidia-smi: {smi}" if smi else
                                                        "; no nvidia-smi")
        need = gpus_expected or 0
        report.add(f"GPUs ({where})", gpus >= need, detail,
                   f"the target's defaults ask for {need} GPU(s) per node; install a CUDA torch "
                   "build or lower resources.gpus_per_node")
    free = info.get("disk_free_gb", 0.0)
    report.add(f"workdir ({where})", bool(info.get("workdir_writable")),
               f"{info.get('workdir')} " + ("writable" if info.get("workdir_writable")
                                            else f"not writable: {info.get('workdir_error')}"),
               f"set 'workdir:' of {target.ref} to a folder you can write on {where}")
    report.add(f"free disk ({where})", free >= MIN_FREE_DISK_GB, f"{free} GiB free in the workdir",
               f"free space or move 'workdir:' (runs need at least {MIN_FREE_DISK_GB:g} GiB for "
               "data and checkpoints)")
    return info


def notebook_versions() -> dict[str, str]:
    """The Workbench and torch versions of this (the notebook's) environment, read from the
    installed distributions (torch is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("workbench", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = ""
    return out


def release(version: str) -> str:
    """``2.13.0+cu126`` -> ``2.13.0``: the node's build of a torch release is its own."""
    return version.split("+", 1)[0]


def check_versions(info: dict[str, Any], target: Target, report: TargetReport, where: str) -> bool:
    """Report whether the target's Workbench and torch (release) are the notebook's."""
    here = notebook_versions()
    there = {"workbench": str(info.get("workbench")), "torch": str(info.get("torch"))}
    drift = [f"{d} {there[d]} there, {here[d]} here" for d in ("workbench", "torch")
             if here[d] and release(there[d]) != release(here[d])]
    made = info.get("setup") or {}
    by = f"; set up by `workbench targets setup` {made['date']}" if made.get("date") else ""
    return report.add(
        f"versions ({where})", not drift,
        ("drift: " + ", ".join(drift)) if drift else
        f"workbench {there['workbench']}, torch {there['torch']} as in the notebook{by}",
        f"run `workbench targets setup {target.ref}` to bring the target's environment to the "
        "notebook's versions")


# How to check each kind of target ("local", "ssh", "slurm"): the backend that runs a kind
# registers its check when its module loads, so target definitions never import backend code (the
# backends import these definitions). ``check_target`` loads a kind's backend module by name the
# first time that kind is checked, as a plugin.
TargetCheck = Callable[[Any, "TargetReport"], None]
_CHECKS: dict[str, TargetCheck] = {}


def register_check(kind: str, check: TargetCheck) -> None:
    """Called by ``workbench.targets.backends.KIND`` as it loads: ``check(target, report)`` probes one."""
    _CHECKS[kind] = check


def check_target(name: str) -> TargetReport:
    """Probe a target: reachability, Python env, torch, GPUs, free disk (and Slurm, partition)."""
    target: Target
    if name == "local":
        kind = "local"
        target = SSHTarget(name="local", hosts=[HostSpec(host="localhost")],
                           python=__import__("sys").executable, workdir=str(home() / "runs"))
    else:
        problem = target_problems().get(name)
        if problem is not None:  # its entry has a mistake: that is the one thing to report
            report = TargetReport(name)
            report.add("targets.yaml entry", False, str(problem),
                       f"correct {name.replace(':', '.', 1)} in {targets_file()} (docs/targets.md "
                       "lists the fields)")
            return report
        target = get_target(name)
        kind = target.kind
    if kind not in _CHECKS:
        importlib.import_module(f"workbench.targets.backends.{kind}")
    report = TargetReport(name)
    _CHECKS[kind](target, report)
    if report.ok:
        # An SSH target's probe runs on its first host, which these checks just saw; a Slurm
        # target's runs on a compute node they cannot see (they run on the login node).
        seen = report.devices.get(target.hosts[0].host) if kind == "ssh" and isinstance(
            target, SSHTarget) else None
        _calibrate(name, report, seen)
    return report


def _calibrate(name: str, report: TargetReport, seen: dict[str, Any] | None = None) -> None:
    """Measure the target for the planner's clock: this machine (workbench.plan.calibrate), or
    a remote target on the target itself (workbench.plan.probe). ``seen``: the device the
    checks found where the probe would run; a probe of that same device is reused, however
    old."""
    from workbench.plan.calibrate import CalibrationError, calibrate, calibration_file

    try:
        if name == "local":
            cal = calibrate(name)
        else:
            from workbench.plan.probe import PROBE_REUSE_S, probe_target

            cal = probe_target(name, reuse_s=PROBE_REUSE_S, device=seen)
    except (CalibrationError, RuntimeError) as exc:
        report.add("calibration", False, f"could not measure {name}: {exc}",
                   "the planner uses the GPU table's peak x utilisation until it can")
        return
    best = max(cal.layers.items(), key=lambda kv: int(kv[0]))
    steady = cal.steadiness(f"layers.{best[0]}")
    unsteady = cal.unsteady()
    report.add("calibration", True,
               f"{cal.matmul_gflops:,.1f} GFLOP/s matmul, {best[1]:,.1f} GFLOP/s forward+backward"
               f" (hidden {best[0]}{', ' + steady if steady else ''}) at {cal.dtype} on "
               f"{cal.device['name']}{' (' + cal.where + ')' if cal.where else ''} {cal.date}; "
               + (f"the clock of {'this machine' if name == 'local' else name} is unsteady: "
                  + ", ".join(f"{k} ±{v * 100:.0f} %" for k, v in sorted(unsteady.items()))
                  + " between readings (measure again when it is quieter); " if unsteady else "")
               + f"stored in {calibration_file(name)}")
