"""What a Slurm partition's nodes offer, read from ``sinfo``, and the two checks that read it:
``workbench targets check`` of a ``slurm:`` target (:func:`check_cluster`), and, before anything
of a run is made, whether enough of the partition's nodes could ever hold what the run asks for
(:func:`check_request`); and, for a job sbatch refused all the same, what to set
(:func:`explain_sbatch`).

The second exists because sbatch accepts some jobs that can never start: more CPUs per node than
any node has, or more nodes than the partition holds, wait in the queue forever (reason
``PartitionConfig``, ``PartitionNodeLimit``) instead of being refused. What the nodes are doing
(down, drained, busy) is not judged here: that changes, and the queue is the place to wait for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.errors import ResourceError
from workbench.runs.home import runs_dir
from workbench.targets.backends.slurm_script import cpus_per_task
from workbench.targets.backends.transport import Result
from workbench.targets.check import TargetReport, check_reachable, probe_environment
from workbench.targets.named import TargetError

if TYPE_CHECKING:
    from workbench.spec import RunSpec
    from workbench.targets.backends.slurm import SlurmBackend
    from workbench.targets.named import SlurmTarget

# One line per partition and kind of node in it: -e groups nodes only when everything shown is the
# same, so CPUs and memory are each node's own (without it sinfo shows the smallest, as "8+").
SINFO = "sinfo -h -e -o '%P|%a|%D|%c|%m|%G|%l'"


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one partition that look alike: one line of :data:`SINFO`."""

    partition: str
    default: bool  # the partition a job goes to when it names none
    available: str  # the partition's state: up, down, drain, inact
    nodes: int
    cpus: int  # per node
    memory_mb: int  # per node
    gres: str  # per node, as Slurm writes it: gpu:2, gpu:a100:4(S:0-1), (null)
    time_limit: str

    @property
    def gpus(self) -> int:
        """GPUs per node: the count of every ``gpu`` entry of the gres, whatever its type."""
        total = 0
        for item in re.sub(r"\([^)]*\)", "", self.gres).split(","):  # (S:0-1): socket binding
            name, *rest = item.strip().split(":")
            if name == "gpu":
                total += int(rest[-1]) if rest and rest[-1].isdigit() else 1
        return total

    def __str__(self) -> str:
        return f"{self.nodes} node(s) with {self.cpus} CPUs, {self.memory_mb} MB, gres {self.gres}"


def read_partitions(scheduler: Callable[[str], Result]) -> list[NodeGroup]:
    """Every node group of every partition, asked with ``scheduler`` (a backend's: sinfo on the
    login node or here). A TargetError with sinfo's words when it cannot answer."""
    res = scheduler(SINFO)
    if res.returncode != 0:
        raise TargetError(f"sinfo failed: {res.text or 'no output'}")
    groups = []
    for line in res.stdout.decode(errors="replace").splitlines():
        fields = line.strip().split("|")
        if len(fields) != 7:
            continue
        part, avail, nodes, cpus, mem, gres, limit = fields
        groups.append(NodeGroup(part.rstrip("*"), part.endswith("*"), avail, _count(nodes),
                                _count(cpus), _count(mem), gres, limit))
    return groups


def _count(text: str) -> int:
    digits = re.match(r"\d+", text.strip())
    return int(digits.group()) if digits else 0


def partition_of(target: SlurmTarget, groups: list[NodeGroup]) -> str | None:
    """The partition the target's jobs go to: its ``partition:``, else the cluster's default."""
    return target.partition or next((g.partition for g in groups if g.default), None)


def check_request(spec: RunSpec, target: SlurmTarget, groups: list[NodeGroup]) -> None:
    """Refuse (ResourceError) a run that the target's partition can never hold: fewer than
    ``resources.nodes`` of its nodes have ``resources.gpus_per_node`` GPUs and the CPUs of the
    run's task (:func:`~workbench.targets.backends.slurm_script.cpus_per_task`) each. A partition
    sinfo does not list is left to sbatch, which refuses it and the message lists the others."""
    name = partition_of(target, groups)
    mine = [g for g in groups if g.partition == name]
    r = spec.resources
    gpus, cpus = r.gpus_per_node, cpus_per_task(spec, target)
    able = sum(g.nodes for g in mine if g.gpus >= gpus and g.cpus >= cpus)
    if not mine or able >= r.nodes:
        return
    most_gpus, most_cpus = max(g.gpus for g in mine), max(g.cpus for g in mine)
    per = "'cpus_per_task:' of the target" if target.cpus_per_task else \
        f"{r.procs_per_node} process(es) x {cpus // r.procs_per_node} CPUs"
    fixes = []
    if gpus > most_gpus:
        fixes.append(f"set resources.gpus_per_node to at most {most_gpus}")
        spec = spec.updated(**{"resources.gpus_per_node": most_gpus})  # what that leaves
    if cpus_per_task(spec, target) > most_cpus:
        fixes.append(f"lower 'cpus_per_task:' of {target.ref} to at most {most_cpus}"
                     if target.cpus_per_task else
                     f"run fewer processes per node (resources.processes_per_node; each gets "
                     f"{cpus // r.procs_per_node} CPUs) or set 'cpus_per_task:' of {target.ref} "
                     f"to at most {most_cpus}")
    total = sum(g.nodes for g in mine)
    if r.nodes > total:
        fixes.append(f"set resources.nodes to at most {total}")
    if not fixes:  # each is there, but not on enough nodes at once
        fixes.append(f"set resources.nodes to at most {able}" if able else
                     "ask for fewer GPUs or CPUs per node: no node has both")
    raise ResourceError(
        f"{target.ref} can never run this: it asks for {r.nodes} node(s) with {gpus} GPU(s) and "
        f"{cpus} CPUs each ({per}), but partition {name!r} has "
        f"{'; '.join(str(g) for g in mine)}. Slurm could never start the job (sbatch may even "
        f"accept it and leave it queued forever), so nothing was submitted. To change: "
        f"{'; '.join(fixes)}; or set 'partition:' of "
        f"{target.ref} to one whose nodes have them (sinfo -o '%P %D %c %m %G' lists them)")


def check_cluster(backend: SlurmBackend, report: TargetReport) -> None:
    """``workbench targets check`` of a Slurm target: the login node, the Slurm client tools,
    the partition and its nodes, and the target's Python environment."""
    target, tr = backend.target, backend.transport
    if target.login and not check_reachable(tr, target.login.host, target.login.destination,
                                            target.connect_timeout, report):
        return
    res = backend.scheduler("command -v sbatch squeue scontrol scancel")
    found = res.stdout.decode(errors="replace").split()
    ok = report.add("slurm client", len(found) == 4, f"{len(found)}/4 of sbatch, squeue, scontrol, "
                    "scancel found", "add the Slurm client tools to PATH via 'setup:' (e.g. "
                    "module load slurm)")
    if not ok:
        return
    try:
        groups = read_partitions(backend.scheduler)
    except TargetError as exc:
        report.add("slurm controller", False, str(exc), "check that slurmctld is up (scontrol ping)")
        return
    want = partition_of(target, groups)
    mine = [g for g in groups if g.partition == want]
    names = ", ".join(dict.fromkeys(g.partition for g in groups))
    report.add("partition", bool(mine),
               f"{want}: {mine[0].available}, {'; '.join(str(g) for g in mine)}, time limit "
               f"{mine[0].time_limit}" if mine else f"{want!r} not found (have: {names})",
               f"set 'partition:' of {target.ref} to one of: {names}")
    where = target.login.host if target.login else "the login node"
    workdir = target.workdir or ("~/workbench-runs" if target.login else str(runs_dir()))
    probe_environment(tr, target, workdir, report, where,
                      None)  # GPUs live on compute nodes; the partition's line shows their gres


def explain_sbatch(err: str, t: SlurmTarget, where: str,
                   scheduler: Callable[[str], Result]) -> str:
    """Why sbatch refused a job (its message ``err``, on the shell at ``where``), with the setting of
    the target ``t`` or of the run spec to change; ``scheduler`` runs a Slurm command there (to
    list the partitions)."""
    low = err.lower()
    msg = f"sbatch refused the job on {where}: {err or 'no output'}\n-> "
    if "partition" in low:
        parts = scheduler("sinfo -h -o %P").stdout.decode(errors="replace").split()
        return msg + (f"set 'partition:' of {t.ref} to one of: {', '.join(parts) or '?'} "
                      "(sinfo lists them)")
    if "account" in low or "association" in low:
        return msg + (f"set 'account:' of {t.ref} to an account you belong to "
                      "(sacctmgr show assoc user=$USER)")
    if "qos" in low:
        return msg + f"set 'qos:' of {t.ref} to a QOS your account may use"
    if "time limit" in low:
        return msg + f"lower 'time:' of {t.ref} below the partition's limit (sinfo -o '%P %l')"
    if "node configuration is not available" in low or "node count" in low or "gres" in low:
        return msg + ("no node (or not enough nodes) offers what the run asks for; lower "
                      "resources.nodes / resources.gpus_per_node, or 'cpus_per_task:' / "
                      f"'mem:' of {t.ref} (sinfo -o '%P %D %c %m %G' shows what exists)")
    if "command not found" in low or "no such file" in low:
        return msg + (f"Slurm's client tools are not on PATH there; add e.g. 'setup: "
                      f"[module load slurm]' to {t.ref}")
    return msg + f"fix the option named above in {t.ref} (targets.yaml) or the run spec"
