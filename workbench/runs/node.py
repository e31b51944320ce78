"""Where a node sits in a run and how its ranks are launched: :class:`NodeRole` (one node, or
node R of N meeting at a rendezvous) and the launcher command the supervisor starts for it
(:mod:`workbench.runs.launcher` on a single node, torchrun across nodes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeRole:
    """Where this node sits in a multi-node run (all defaults: a single node, standalone)."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT on node 0 where the nodes meet
    rdzv_id: str | None = None
    # This node's run directory is not node 0's (no shared folder): it starts from the snapshot
    # in checkpoint.storage, and it cannot see node 0's snapshots to agree on a restart.
    own_folder: bool = False

    @property
    def writes_status(self) -> bool:
        return self.node_rank == 0  # one writer of status.json per run

    @property
    def launcher_log(self) -> str:
        # On a shared filesystem every node writes into the same logs/: one file per node.
        return "launcher.log" if self.nnodes == 1 else f"launcher-node{self.node_rank}.log"


def launcher_command(nproc: int, train_args: list[str]) -> list[str]:
    """One node's ranks without torchrun (:mod:`workbench.runs.launcher`): no torch import first."""
    return [sys.executable, "-m", "workbench.runs.launcher", str(nproc), "-m", "workbench.train",
            *train_args]


def torchrun_command(run_dir: Path, nproc: int, role: NodeRole = NodeRole()) -> list[str]:
    """The launcher of this node's ranks: :mod:`workbench.runs.launcher` on a single node, torchrun
    with a static rendezvous across nodes."""
    if role.nnodes == 1:
        return launcher_command(nproc, [str(run_dir)])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    # A static rendezvous: torchrun honours --node_rank only with it (c10d hands out ranks in
    # arrival order), so global rank 0 -- the writer of metrics, snapshots and the adapter --
    # runs on node 0, whose run directory is the one of record.
    addr, _, port = (role.rdzv_endpoint or "").rpartition(":")
    cmd += [f"--nnodes={role.nnodes}", f"--node_rank={role.node_rank}",
            "--rdzv_backend=static", f"--master_addr={addr}", f"--master_port={port}",
            f"--rdzv_id={role.rdzv_id or run_dir.name}"]
    return cmd + ["-m", "workbench.train", str(run_dir)]
