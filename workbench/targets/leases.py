"""GPU leases on this machine: which CUDA devices each live local run (or endpoint) holds.

Two local runs that each want one GPU must not both land on ``cuda:0``. A run's supervisor
leases devices before it starts the ranks, sets ``CUDA_VISIBLE_DEVICES`` to them, and releases
them when its ranks are gone. A lease is one JSON file under
``$WORKBENCH_HOME/gpu-leases/<host>/`` naming the holder by its full process identity
(:mod:`workbench.runs.procs`: PID *and* start time), so a holder that died, even by ``kill -9``, frees
its devices for the next taker, and a reused PID cannot keep them. Allocation reads every lease
and writes the new one under one file lock.

Device ids are what ``CUDA_VISIBLE_DEVICES`` takes: the ids this process may see (its own
``CUDA_VISIBLE_DEVICES``, or ``0..count-1``), so a notebook already restricted to some cards
hands out only those.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from workbench.errors import ResourceError
from workbench.runs.home import home
from workbench.runs.procs import ProcessIdentity, hostname


@dataclass(frozen=True)
class Lease:
    """Devices held by one live process for one owner (a run or endpoint name)."""

    owner: str
    devices: tuple[str, ...]
    holder: ProcessIdentity


def lease_dir(root: Path | None = None) -> Path:
    return (root or home()) / "gpu-leases" / hostname()


def visible_devices() -> list[str]:
    """The CUDA device ids this process may hand out (imports torch only without a CUDA mask)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return [d.strip() for d in mask.split(",") if d.strip()]
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [str(i) for i in range(count)]


def _file(directory: Path, owner: str) -> Path:
    return directory / f"{owner}.json"


def held(root: Path | None = None) -> list[Lease]:
    """The leases of live holders; a dead holder's lease file is removed (its devices are free)."""
    directory = lease_dir(root)
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            lease = Lease(str(data["owner"]), tuple(data["devices"]),
                          ProcessIdentity.from_dict(data["holder"]))
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable: written by nothing we know (we write atomically); it holds nothing.
            path.unlink(missing_ok=True)
            continue
        if lease.holder.process() is None:
            path.unlink(missing_ok=True)
            continue
        out.append(lease)
    return out


def acquire(owner: str, count: int, holder: ProcessIdentity, *,
            devices: Sequence[str] | None = None, root: Path | None = None) -> list[str]:
    """Lease ``count`` devices for ``owner``, held while ``holder`` lives; returns their ids.

    ``devices`` is what may be handed out (default :func:`visible_devices`). An owner that holds
    a lease already gets it replaced. Raises ResourceError, naming who holds what, when fewer
    than ``count`` are free.
    """
    pool = list(devices) if devices is not None else visible_devices()
    directory = lease_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / ".lock")):
        others = [le for le in held(root) if le.owner != owner]
        free = _free_or_raise(owner, count, pool, others)
        chosen = free[:count]
        path = _file(directory, owner)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"owner": owner, "devices": chosen,
                                   "holder": holder.to_dict()}))
        tmp.replace(path)
    return chosen


def _free_or_raise(owner: str, count: int, pool: list[str], others: list[Lease]) -> list[str]:
    if len(pool) < count:
        raise ResourceError(
            f"{owner} needs {count} GPU(s) but {hostname()} shows "
            f"{len(pool) or 'no'} CUDA device(s) to this process (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); set resources.gpus_per_node "
            f"to at most {len(pool)} (0 trains on CPU)")
    taken = {d for le in others for d in le.devices}
    free = [d for d in pool if d not in taken]
    if len(free) < count:
        holders = "; ".join(f"{le.owner} holds GPU {','.join(le.devices)} "
                            f"({le.holder.describe()})" for le in others) or "nobody"
        raise ResourceError(
            f"{owner} needs {count} GPU(s) but only {len(free)} of {len(pool)} on "
            f"{hostname()} are free ({holders}); wait for those runs to end, cancel one, or set "
            "resources.gpus_per_node lower")
    return free


def release(owner: str, holder: ProcessIdentity, root: Path | None = None) -> bool:
    """Give back ``owner``'s devices if ``holder`` holds them (a later attempt's lease is kept)."""
    directory = lease_dir(root)
    path = _file(directory, owner)
    if not directory.is_dir():
        return False
    with FileLock(str(directory / ".lock")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if not ProcessIdentity.from_dict(data["holder"]).same(holder):
            return False
        path.unlink(missing_ok=True)
    return True


def check_free(owner: str, count: int, devices: Sequence[str] | None = None,
               root: Path | None = None) -> None:
    """Raise ResourceError, naming who holds what, unless ``count`` devices are free right now
    (nothing is leased: a check before starting, not a reservation)."""
    pool = list(devices) if devices is not None else visible_devices()
    directory = lease_dir(root)
    others: list[Lease] = []
    if directory.is_dir():
        with FileLock(str(directory / ".lock")):  # held() removes dead holders' files
            others = held(root)
    _free_or_raise(owner, count, pool, others)
