"""GPU leases on this machine: which CUDA devices each live local run (or endpoint) holds.

Two local runs that each want one GPU must not both land on ``cuda:0``. A run's supervisor
leases devices before it starts the ranks, sets ``CUDA_VISIBLE_DEVICES`` to them, and releases
them when its ranks are gone. The leases are the machine's, not one WORKBENCH_HOME's: every
home and every user on the machine (a course's students) leases from one folder,
``$WORKBENCH_LEASES`` or ``/var/tmp/workbench-gpu-leases``, then ``<host>/`` (sticky and
world-writable, as /tmp is). A lease is one JSON file there naming its owner (a run or endpoint,
and the home it belongs to) and its holder by full process identity
(:mod:`workbench.runs.procs`: PID *and* start time), so a holder that died, even by ``kill -9``,
frees its devices for the next taker, and a reused PID cannot keep them. A lease counts only when
its holder is a process of the user who wrote the file, so nobody holds cards in another user's
name. Allocation reads every lease and writes the new one under one file lock.

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

SHARED = Path("/var/tmp/workbench-gpu-leases")


@dataclass(frozen=True)
class Lease:
    """Devices held by one live process for one owner (a run or endpoint name) of one home."""

    owner: str
    devices: tuple[str, ...]
    holder: ProcessIdentity
    home: str = ""


def lease_dir(root: Path | None = None) -> Path:
    """The machine's lease folder (``root``: a folder of one's own instead, as tests use)."""
    if root is not None:
        return root / "gpu-leases" / hostname()
    return Path(os.environ.get("WORKBENCH_LEASES") or SHARED) / hostname()


def _ensure(directory: Path) -> None:
    """Make the folder, writable by every user of the machine and sticky (each removes only
    their own files), as far as this user may set it."""
    for folder in (directory.parent, directory):
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            try:
                folder.chmod(0o1777)
            except PermissionError:
                pass


def _lock(directory: Path) -> FileLock:
    return FileLock(str(directory / ".lock"), mode=0o666)


def _home() -> str:
    return str(home())


def visible_devices() -> list[str]:
    """The CUDA device ids this process may hand out (imports torch only without a CUDA mask)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return [d.strip() for d in mask.split(",") if d.strip()]
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [str(i) for i in range(count)]


def _file(directory: Path, owner: str) -> Path:
    """One file per owner and home: two homes' runs of the same name hold apart."""
    import hashlib

    digest = hashlib.sha256(_home().encode()).hexdigest()[:10]
    return directory / f"{owner}.{digest}.json"


def _drop(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except PermissionError:  # another user's file in the sticky folder: it holds nothing
        pass


def held(root: Path | None = None) -> list[Lease]:
    """The leases of live holders; a dead holder's lease file is removed (its devices are free)."""
    directory = lease_dir(root)
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            lease = Lease(str(data["owner"]), tuple(data["devices"]),
                          ProcessIdentity.from_dict(data["holder"]), str(data.get("home", "")))
            writer = path.stat().st_uid
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable: written by nothing we know (we write atomically); it holds nothing.
            _drop(path)
            continue
        proc = lease.holder.process()
        if proc is None:
            _drop(path)
            continue
        try:
            if proc.uids().real != writer:  # a lease in someone else's name holds nothing
                continue
        except Exception:  # gone between the two looks
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
    _ensure(directory)
    with _lock(directory):
        others = [le for le in held(root) if (le.owner, le.home) != (owner, _home())]
        free = _free_or_raise(owner, count, pool, others)
        chosen = free[:count]
        path = _file(directory, owner)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"owner": owner, "home": _home(), "devices": chosen,
                                   "holder": holder.to_dict()}))
        tmp.chmod(0o644)  # every user's allocation reads it
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
                            f"({le.holder.describe()}{_elsewhere(le)})" for le in others) or "nobody"
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
    with _lock(directory):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if not ProcessIdentity.from_dict(data["holder"]).same(holder):
            return False
        _drop(path)
    return True


def check_free(owner: str, count: int, devices: Sequence[str] | None = None,
               root: Path | None = None) -> None:
    """Raise ResourceError, naming who holds what, unless ``count`` devices are free right now
    (nothing is leased: a check before starting, not a reservation)."""
    pool = list(devices) if devices is not None else visible_devices()
    directory = lease_dir(root)
    others: list[Lease] = []
    if directory.is_dir():
        with _lock(directory):  # held() removes dead holders' files
            others = held(root)
    _free_or_raise(owner, count, pool, others)


def _elsewhere(lease: Lease) -> str:
    return f", of {lease.home}" if lease.home and lease.home != _home() else ""
