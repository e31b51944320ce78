"""Kernelspecs for remote kernels: one per target, in the user's Jupyter data folder.

``workbench kernels install slurm:gpu --gpus 1 --time 2h`` writes ``workbench-slurm-gpu`` with
the display name "Workbench on gpu (1 GPU)" and, in ``metadata.kernel_provisioner``, the
:mod:`workbench.targets.kernels.provisioner` and its config; JupyterLab's launcher lists it like any
kernel. The kernelspec's ``argv`` is the command the provisioner runs on the target (for people
reading it; the provisioner builds it). ``list_kernels`` and ``remove_kernel`` see only the
kernelspecs written here (their ``metadata.workbench`` says so).

    >>> parse_duration("2h"), slurm_time(5400)
    (7200.0, '01:30:00')
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from workbench.errors import WorkbenchError
from workbench.targets.kernels.heartbeat import BEAT_EVERY_S, MIN_ORPHAN_S, ORPHAN_AFTER_S
from workbench.targets.kernels.placement import MODULE
from workbench.targets.kernels.provisioner import NAME as PROVISIONER
from workbench.targets.named import get_target

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 60.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}  # bare numbers: minutes
LOGO = Path(__file__).resolve().parents[2] / "kernels" / "workbench" / "logo-svg.svg"


def parse_duration(text: str) -> float:
    """Seconds in ``2h``, ``30m``, ``90s``, ``1d`` (a bare number is minutes, as in Slurm) or
    Slurm's ``HH:MM:SS``."""
    m = _DURATION.match(text)
    if m:
        return float(m.group(1)) * _UNITS[m.group(2)]
    parts = text.strip().split(":")
    if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        h, mnt, s = ([0] * (3 - len(parts)) + [int(p) for p in parts])
        return float(h * 3600 + mnt * 60 + s)
    raise WorkbenchError(f"{text!r} is not a duration; write e.g. 2h, 30m, 90s or 02:00:00")


def slurm_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def kernel_name(target: str) -> str:
    return "workbench-" + re.sub(r"[^a-z0-9._-]", "-", target.lower().replace(":", "-"))


def install_kernel(target: str, gpus: int = 0, time: str = "1h", cull_idle: str | None = None,
                   wait: str = "5m", prefix: str | None = None,
                   budget: float | None = None, orphan_after: str | None = None) -> str:
    """Write the kernelspec for ``target`` and return its name. ``cull_idle`` defaults to 1h for a
    kernel with GPUs and to never (``0``) without; ``budget`` stops the kernel once its sessions
    cost that much at the target's price (a restart counts on); ``orphan_after`` is how long the
    kernel outlives a client that stopped beating (default 30 s, at least 10 s)."""
    t = get_target(target)  # an unknown target is refused here, with the known ones
    if gpus < 0:
        raise WorkbenchError(f"--gpus must be 0 or more, not {gpus}")
    if budget is not None and budget <= 0:
        raise WorkbenchError(f"--budget must be more than 0, not {budget:g} (leave it out for none)")
    cull = parse_duration(cull_idle) if cull_idle is not None else (3600.0 if gpus else 0.0)
    orphan = parse_duration(orphan_after) if orphan_after is not None else ORPHAN_AFTER_S
    if orphan < MIN_ORPHAN_S:
        raise WorkbenchError(f"--orphan-after must be at least {MIN_ORPHAN_S:g}s (the client beats "
                             f"every {BEAT_EVERY_S:g} s), not {orphan_after}")
    what = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "CPU"
    spec: dict[str, Any] = {
        "argv": [t.python, "-m", MODULE, "-f", "{connection_file}"],
        "display_name": f"Workbench on {t.name} ({what})",
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {
            "debugger": True,
            "workbench": {"target": target},
            "kernel_provisioner": {"provisioner_name": PROVISIONER, "config": {
                "target": target, "gpus": gpus, "time_limit": slurm_time(parse_duration(time)),
                "cull_idle_s": cull, "wait_s": parse_duration(wait),
                "budget_limit": budget or 0.0, "orphan_after_s": orphan}},
        },
    }
    name = kernel_name(target)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        (folder / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        if LOGO.is_file():
            shutil.copy(LOGO, folder / "logo-svg.svg")
        KernelSpecManager().install_kernel_spec(str(folder), name, user=prefix is None,
                                                prefix=prefix)
    return name


def list_kernels() -> list[dict[str, Any]]:
    """The Workbench remote kernelspecs: name, display name, target, config, folder."""
    out = []
    for name, found in sorted(KernelSpecManager().get_all_specs().items()):
        meta = found["spec"].get("metadata", {})
        if "workbench" in meta and "kernel_provisioner" in meta:
            out.append({"name": name, "display_name": found["spec"]["display_name"],
                        "target": meta["workbench"]["target"],
                        "config": meta["kernel_provisioner"].get("config", {}),
                        "resource_dir": found["resource_dir"]})
    return out


def remove_kernel(name: str) -> str:
    """Remove a Workbench kernelspec by its name or target (``slurm:gpu``); its folder."""
    for k in list_kernels():
        if name in (k["name"], k["target"]):
            try:
                return str(KernelSpecManager().remove_kernel_spec(k["name"]))
            except NoSuchKernel:
                break
    names = ", ".join(k["name"] for k in list_kernels()) or "none"
    raise WorkbenchError(f"no Workbench kernel named {name!r} (installed: {names}); "
                         "`workbench kernels list` shows them")


def kernels_table() -> str:
    """The installed kernels: TIME LIMIT is the Slurm allocation's ``--time`` ("none" on SSH, where
    nothing limits it), ORPHAN AFTER how long it outlives a client that stopped beating, HELD the
    time its target's kernel sessions held it (ledger, settled)."""
    from workbench.targets.kernels.ledger import sessions

    held: dict[str, float] = {}
    running: dict[str, int] = {}
    for s in sessions():
        held[s["target"]] = held.get(s["target"], 0.0) + float(s.get("billed_s") or 0.0)
        if s.get("ended") is None:
            running[s["target"]] = running.get(s["target"], 0) + 1
    rows = [("NAME", "DISPLAY NAME", "TARGET", "GPUS", "TIME LIMIT", "CULL IDLE", "ORPHAN AFTER",
             "HELD")]
    for k in list_kernels():
        c, t = k["config"], k["target"]
        cull = slurm_time(c.get("cull_idle_s", 0)) if c.get("cull_idle_s") else "never"
        limit = c.get("time_limit", "-") if t.startswith("slurm:") else "none"
        now = f" ({running[t]} running)" if running.get(t) else ""
        orphan = slurm_time(c.get("orphan_after_s") or ORPHAN_AFTER_S)
        rows.append((k["name"], k["display_name"], t, str(c.get("gpus", 0)), limit, cull, orphan,
                     slurm_time(held.get(t, 0.0)) + now))
    if len(rows) == 1:
        return "no Workbench remote kernels; add one with `workbench kernels install ssh:NAME`"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
