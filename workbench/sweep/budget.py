"""The sweep's one budget: what it has spent (the final bills of its ended trials), what it holds
(the whole ``budget.limit`` of every trial under way) and what a trial is priced at before it
starts (the planner's cost with a margin, plus starting and releasing its processes).

A run never passes its own limit, so a trial that starts only when its price fits in what is
neither spent nor held keeps the sum of the trials' costs under the sweep's limit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.runs.budget import KILL_GRACE_S, RELEASE_S, hourly_price
from workbench.spec import RunSpec
from workbench.sweep import record as rec

# The planner's price of a trial is an estimate (start-up on a busy machine is not in it): a trial
# starts only when this multiple of it, plus starting and releasing, fits in what is left.
PRICE_MARGIN = 1.5
# The share of its cores a CPU run alone keeps busy (/proc/stat while a 2-process run of the tiny
# model trains on 2 cores: 136-179 of every 200 core-ticks busy).
BUSY = 0.8
# The controller measures the other load on the machine (machine_load) at most this often.
LOAD_FRESH_S = 30.0


@dataclass(frozen=True)
class MachineLoad:
    """What else keeps this machine's CPU busy while a sweep prices a trial: ``others`` is how
    many claimants besides the sweep's own processes wanted a core, on average over a short
    window; ``grouped``: Linux with autogroups on (its default) shares the CPU between sessions
    first, so a claimant is a session with a runnable thread; without them, a runnable thread."""

    others: float = 0.0
    grouped: bool = False


def _threads() -> list[tuple[int, str, int]]:
    """(process id, scheduler state, session id) of every thread on this machine, from /proc."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # ended meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8",
                          errors="replace") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
            found.append((int(pid), fields[0], int(fields[3])))
    return found


def machine_load(window_s: float = 0.5, samples: int = 10) -> MachineLoad:
    """Sample, ``samples`` times over ``window_s``, the threads that want a core (state R) and
    are not this process's or its descendants' (the controller and the trials it started):
    the load a trial shares the machine with besides its sibling trials. Idle (0) where /proc
    cannot be read."""
    import psutil

    try:
        grouped = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        grouped = False
    if not Path("/proc/self/task").is_dir():
        return MachineLoad(0.0, grouped)
    me = psutil.Process()
    counts = []
    for i in range(samples):
        ours = {me.pid, *(c.pid for c in me.children(recursive=True))}
        threads = _threads()
        mine = {sid for pid, _, sid in threads if pid in ours}
        # Kernel threads (session 0) run briefly for everyone; they are no claimant.
        wanting = [(pid, sid) for pid, state, sid in threads
                   if state == "R" and sid != 0 and pid not in ours and sid not in mine]
        counts.append(len({sid for _, sid in wanting}) if grouped else len(wanting))
        if i + 1 < samples:
            time.sleep(window_s / samples)
    return MachineLoad(sum(counts) / len(counts), grouped)


def sharing(spec: RunSpec, at_once: int, load: MachineLoad | None = None) -> float:
    """How many times longer a trial holds its processes because ``at_once`` trials run on this
    machine's CPU cores together (1: no slower), beside ``load`` (None: nothing else runs).

    The planner times a run as earlier runs of it went, beside whatever ran then. Once the
    claimants on the cores outnumber them, they take turns, start-up and steps alike: each
    trial (its ranks, in a session of their own) gets its part of the cores, and a trial
    beside others gets less than one alone, by less the more the machine is busy with other
    work (which takes its part either way). A run alone keeps its cores BUSY of the time (it
    also waits on its disk and its ranks on each other), which the others' turns fill first.
    Measured on 2 cores, two 2-process trials of the tiny model held 1.5-2.0 times as long as
    the same run alone minutes before (median 1.8; 1.15 and 3.1 once each, as the host's own
    speed came and went); beside one busy session (two CPU hogs) 1.4-1.8 times (median 1.55),
    beside two busy sessions 1.2 times. Trials on GPUs, or on other targets, share no cores here.
    """
    r = spec.resources
    if at_once <= 1 or spec.target != "local" or r.gpus_per_node != 0:
        return 1.0
    cores, procs = os.cpu_count() or 1, r.world_size
    load = load or MachineLoad()

    def rate(n: int) -> float:
        """Cores one of ``n`` trials gets beside the load."""
        if load.grouped:
            return min(procs, cores / (load.others + n))
        return procs * min(1.0, cores / (load.others + n * procs))

    share = rate(1) / rate(at_once)
    return max(1.0, 1.0 + (share - 1.0) * BUSY)


def trial_price(spec: RunSpec, at_once: int = 1, load: MachineLoad | None = None
                ) -> tuple[float | None, float]:
    """The planner's cost of a trial of ``spec``, slowed by the ``at_once`` trials it runs
    beside on a machine under ``load`` (:func:`sharing`), and what the controller sets aside
    before it starts one: that cost times PRICE_MARGIN, plus starting and releasing its
    processes."""
    from workbench.plan import plan

    planned = plan(spec).cost
    if planned is not None:
        planned *= sharing(spec, at_once, load)
    per_hour, _ = hourly_price(spec)
    return planned, (planned or 0.0) * PRICE_MARGIN + per_hour * (KILL_GRACE_S + RELEASE_S) / 3600.0


def spent(data: dict[str, Any]) -> float:
    """What the sweep has spent: the final bills of its ended trials."""
    return sum(float(t.get("cost") or 0.0) for t in data["trials"] if t.get("released"))


def held(data: dict[str, Any]) -> float:
    """What the sweep holds for trials under way: their limits (not spent yet)."""
    return sum(float(t["limit"]) for t in data["trials"] if not t.get("released") and
               t.get("state") not in (rec.WAITING, rec.SKIPPED) and t.get("limit") is not None)


def money(data: dict[str, Any]) -> str:
    """'spent 12.3 · held 40 of 100 CNY': what was spent and what is held, apart."""
    budget = f" of {data['budget']:g}" if data.get("budget") else ""
    holding = held(data)
    return (f"spent {spent(data):.4g}" + (f" · held {holding:.4g}" if holding else "")
            + f"{budget} {data.get('currency', '')}").rstrip()


def committed(data: dict[str, Any]) -> float:
    """What the sweep has spent or promised: final bills of ended trials, limits of the rest."""
    return spent(data) + held(data)
