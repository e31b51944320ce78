"""Snapshots: verified, resumable training state under RUN_DIR/checkpoints, optionally mirrored
to a storage URL (a folder or s3:// on any S3-compatible endpoint, through fsspec).

A snapshot ``checkpoints/step-N/`` counts only once its ``manifest.json`` (sha256 and size of
every file) is written — the manifest is written last, atomically, so a crash mid-snapshot leaves
a folder without one — and ``checkpoints/latest`` names the newest verified snapshot. Resume walks
snapshots newest first, verifies each against its manifest and skips (with a warning) any that is
partial or corrupt. Rank 0 alone verifies at start and tells the other ranks what it found
(:func:`agreed_resume_point`), so a snapshot is hashed once per attempt, not once per rank.

A snapshot that failed (a rank could not write its part, the commit or the upload failed) is
recorded in status.json as ``snapshot_error`` (step, stage, reason) until a later snapshot gets
through the same stage. With a storage URL, a snapshot the uploader still owes is never pruned:
it is pruned once its upload has ended.

    >>> newest_verified(RunDir("runs/x"))     # doctest: +SKIP
    PosixPath('runs/x/checkpoints/step-40')
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs.rundir import RunDir, write_json_atomic

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class SnapshotError(WorkbenchError, RuntimeError):
    """A snapshot could not be written, verified or fetched."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def snapshot_dir(rd: RunDir, step: int) -> Path:
    return rd.path / "checkpoints" / f"step-{step}"


def write_manifest(folder: Path, step: int,
                   known: dict[str, tuple[str, int]] | None = None) -> dict[str, Any]:
    """Write folder/manifest.json. ``known`` maps file names to (sha256, bytes) already computed
    while writing them, so big files are not read back just to be hashed."""
    known = known or {}
    files = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name == MANIFEST:
            continue
        rel, size = str(p.relative_to(folder)), p.stat().st_size
        digest, nbytes = known.get(rel, (None, -1))
        files[rel] = {"sha256": digest if nbytes == size else sha256_file(p), "bytes": size}
    manifest = {"step": step, "created": time.time(), "files": files}
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def verify(folder: Path) -> str | None:
    """None when the snapshot is complete and intact, else why not."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (the snapshot was never completed)"
    except json.JSONDecodeError:
        return "unreadable manifest"
    for rel, meta in manifest["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def snapshots(rd: RunDir) -> list[Path]:
    """Every step-N folder, newest first (verified or not)."""
    root = rd.path / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step-*")
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()] if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def newest_verified(rd: RunDir) -> Path | None:
    for folder in snapshots(rd):
        problem = verify(folder)
        if problem is None:
            return folder
        warnings.warn(f"skipping snapshot {folder.name}: {problem}", stacklevel=2)
    return None


def set_latest(rd: RunDir, folder: Path) -> None:
    latest = rd.path / "checkpoints" / "latest"
    tmp = latest.with_name(f".latest.{os.getpid()}")
    tmp.write_text(folder.name + "\n")
    os.replace(tmp, latest)


def agreed_resume_point(rd: RunDir) -> Path | None:
    """The snapshot every rank resumes from: rank 0 verifies (newest first) and sends the others
    its choice, so each snapshot is hashed once, and all ranks start from the same step even if
    a file changed while they looked."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return newest_verified(rd)
    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        folder = newest_verified(rd)
        found = [folder.name if folder is not None else None]
    dist.broadcast_object_list(found, src=0)
    return rd.path / "checkpoints" / found[0] if found[0] else None


def prune(rd: RunDir, keep: int, hold: Collection[str] = ()) -> None:
    """Keep the newest ``keep`` verified snapshots (and anything newer that is in flight), and
    those named in ``hold`` (still owed to the storage URL)."""
    kept = 0
    for folder in snapshots(rd):
        if (folder / MANIFEST).is_file():
            kept += 1
            if kept > keep and folder.name not in hold:
                shutil.rmtree(folder, ignore_errors=True)


def commit(rd: RunDir, trainer_folder: Path, step: int, keep: int,
           known: dict[str, tuple[str, int]] | None = None,
           uploader: Uploader | None = None) -> Path:
    """Turn the Trainer's checkpoint-N into a verified step-N: rename, manifest, latest, prune
    (never what ``uploader`` still owes), then hand it to ``uploader``."""
    folder = snapshot_dir(rd, step)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(trainer_folder, folder)
    write_manifest(folder, step, known)
    set_latest(rd, folder)
    prune(rd, keep, uploader.held() if uploader is not None else ())
    clear_error(rd, step, "write")
    if uploader is not None:
        uploader.submit(folder)
    return folder


# -- failures -----------------------------------------------------------------------------------

def record_error(rd: RunDir, step: int, stage: str, exc: BaseException) -> None:
    """Show in status.json (``snapshot_error``) that snapshot ``step`` failed at ``stage``:
    ``write`` (a rank's files, or the commit) or ``upload`` (the copy to the storage URL)."""
    reason = str(exc) or type(exc).__name__
    rd.write_status(snapshot_error={"step": step, "stage": stage, "error": reason,
                                    "time": time.time()})


def clear_error(rd: RunDir, step: int, stage: str) -> None:
    """Snapshot ``step`` got through ``stage``: an error of that stage at or before it is over."""
    err = rd.status().get("snapshot_error")
    if err and err.get("stage") == stage and int(err.get("step", 0)) <= step:
        rd.write_status(snapshot_error=None)


# -- storage ------------------------------------------------------------------------------------

def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    kwargs: dict[str, Any] = {}
    if url.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        kwargs["client_kwargs"] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    fs, root = fsspec.core.url_to_fs(url, **kwargs)
    return fs, root.rstrip("/")


class StorageError(SnapshotError):
    """``checkpoint.storage`` cannot be reached: no such bucket, credentials refused, no endpoint."""


def check_storage(url: str) -> None:
    """Refuse a remote ``checkpoint.storage`` this machine cannot list before a run is started
    on it: otherwise the first upload fails minutes into training, after the money is spent."""
    if "://" not in url or url.startswith("file://"):
        return  # a local folder is created on first use
    try:
        fs, root = _fs(url)
        bucket = root.split("/", 1)[0]
        fs.ls(bucket, detail=False)
    except FileNotFoundError:
        raise StorageError(
            f"checkpoint.storage {url}: the bucket {bucket!r} does not exist"
            + (f" at {os.environ['AWS_ENDPOINT_URL']}" if os.environ.get("AWS_ENDPOINT_URL") else "")
            + "; create it, or fix checkpoint.storage") from None
    except PermissionError as exc:
        raise StorageError(
            f"checkpoint.storage {url}: access refused ({exc}); set credentials that may write "
            "there (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE for S3), or fix "
            "checkpoint.storage") from None
    except Exception as exc:  # no endpoint, no network, an unknown protocol: say what it was
        raise StorageError(f"checkpoint.storage {url} cannot be reached: {exc!r}; check the "
                           "URL, the endpoint (AWS_ENDPOINT_URL) and the network") from None


def storage_prefix(url: str, run_id: str) -> str:
    return f"{url.rstrip('/')}/{run_id}"


def upload(folder: Path, url: str) -> None:
    """Copy a verified snapshot to ``url`` (files first, manifest last, then latest)."""
    fs, root = _fs(url)
    dest = f"{root}/{folder.name}"
    manifest = json.loads((folder / MANIFEST).read_text())
    for rel in manifest["files"]:
        fs.makedirs(os.path.dirname(f"{dest}/{rel}"), exist_ok=True)
        fs.put_file(str(folder / rel), f"{dest}/{rel}")
    fs.put_file(str(folder / MANIFEST), f"{dest}/{MANIFEST}")
    with fs.open(f"{root}/latest", "w") as fh:
        fh.write(folder.name + "\n")


def stored_latest(url: str) -> str | None:
    """The snapshot name storage at ``url`` calls latest (None: nothing uploaded yet)."""
    fs, root = _fs(url)
    try:
        return str(fs.cat_file(f"{root}/latest").decode().strip())
    except FileNotFoundError:
        return None


def fetch_latest(url: str, rd: RunDir) -> Path | None:
    """Download the newest snapshot in ``url`` that verifies into RUN_DIR/checkpoints."""
    fs, root = _fs(url)
    try:
        names = sorted((p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)),
                       key=lambda n: int(m.group(1)) if (m := _STEP_DIR.match(n)) else -1,
                       reverse=True)
    except FileNotFoundError:
        return None
    for name in names:
        if not _STEP_DIR.match(name):
            continue
        local = rd.path / "checkpoints" / name
        shutil.rmtree(local, ignore_errors=True)
        try:
            fs.get(f"{root}/{name}", str(local), recursive=True)
        except FileNotFoundError:
            continue
        problem = verify(local)
        if problem is None:
            set_latest(rd, local)
            return local
        warnings.warn(f"skipping stored snapshot {name}: {problem}", stacklevel=2)
        shutil.rmtree(local, ignore_errors=True)
    return None


class Uploader:
    """Uploads committed snapshots in a background thread so training never waits on the network.

    Progress is reported to status.json (``upload``: pending / uploading / uploaded step, or the
    error, also as ``snapshot_error``), which the job view shows. A snapshot is held back from
    pruning from ``submit`` until its upload has ended; then the uploader prunes to ``keep``.
    """

    def __init__(self, rd: RunDir, url: str, keep: int | None = None) -> None:
        self.rd, self.url, self.keep = rd, url, keep
        # (snapshot, only if storage lacks it as latest), or None to stop.
        self._queue: queue.Queue[tuple[Path, bool] | None] = queue.Queue()
        self._owed: set[str] = set()  # snapshot names queued or being uploaded
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, daemon=True, name="snapshot-upload")
        self._thread.start()

    def held(self) -> set[str]:
        """The snapshots not to prune yet: queued or being uploaded."""
        with self._lock:
            return set(self._owed)

    def submit(self, folder: Path) -> None:
        with self._lock:
            self._owed.add(folder.name)
        self.rd.write_status(upload={"state": "pending", "step": folder.name})
        self._queue.put((folder, False))

    def catch_up(self, folder: Path | None) -> None:
        """Upload ``folder``, the newest verified snapshot when an attempt starts, unless storage
        already names it latest: an earlier attempt that died before its upload ended still owes
        it, and a resume elsewhere would otherwise start from an older stored step."""
        if folder is None:
            return
        with self._lock:
            self._owed.add(folder.name)
        self._queue.put((folder, True))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            folder, only_if_missing = item
            step = int(folder.name.split("-", 1)[1])
            try:
                if only_if_missing and stored_latest(self.url) == folder.name:
                    continue
                self.rd.write_status(upload={"state": "uploading", "step": folder.name})
                upload(folder, self.url)
                self.rd.write_status(upload={"state": "uploaded", "step": folder.name,
                                             "url": self.url})
                clear_error(self.rd, step, "upload")
            except Exception as exc:  # keep training; the status shows what went wrong
                self.rd.write_status(upload={"state": "failed", "step": folder.name,
                                             "error": str(exc)})
                record_error(self.rd, step, "upload", exc)
            finally:
                with self._lock:
                    self._owed.discard(folder.name)
                if self.keep is not None:  # what the commits had to keep for us may go now
                    prune(self.rd, self.keep, self.held())

    def close(self, timeout: float = 600) -> None:
        """Finish pending uploads (called at the end of training)."""
        self._queue.put(None)
        self._thread.join(timeout)
