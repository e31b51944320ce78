"""Asynchronous snapshots: training waits only for an in-memory copy, a thread writes the files.

The Trainer still decides *what* a checkpoint holds and in which format (so its own resume code
reads it back); while it "saves", its heavy writes (``torch.save`` of optimizer, scheduler and RNG
state, ``safetensors`` files of the weights or adapter) are intercepted: each object is copied to
CPU memory on the spot and written to disk by a background thread. Small JSON files are written
directly. When a rank's writes are done it drops a marker; rank 0's thread waits for the markers
of every rank on its node, then commits the snapshot (rename to step-N, manifest last, latest,
prune, upload) — exactly what the synchronous path does.

Training pays for the copy only: one memcpy per tensor, into the previous snapshot's buffers once
one has been written. The writer thread (nice 19) serialises each file straight to disk, hashing
as it writes (no archive built in memory first), and mostly without the interpreter lock. Its
CPU time is hidden only where a host core is free for it (a GPU node); where training uses every
core, that time comes out of training (see docs/benchmarks.md).

DeepSpeed checkpoints (ZeRO shards written by the engine) take the synchronous path.
"""

from __future__ import annotations

import copy
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch

# Bound at import: a writer thread may run while the next snapshot's capture has patched them.
_REAL_TORCH_SAVE = torch.save
_SAFETENSORS = __import__("safetensors.torch", fromlist=["save_file"])
_REAL_SAVE_FILE = _SAFETENSORS.save_file
_CHUNK = 64 << 20
# Benchmark only: CPUs the writer thread may run on ("1" or "1,3"), to model a GPU node's host.
WRITER_CPUS_ENV = "WORKBENCH_SNAPSHOT_WRITER_CPUS"


class _HashingFile:
    """A write-only file for ``torch.save``: each piece is hashed and written as it arrives.

    torch hands over memoryviews of the tensor memory, so the bytes go from the CPU copy to the
    file in one pass (no in-memory archive first); hashing and writing large pieces both release
    the interpreter lock.
    """

    def __init__(self, fh: Any) -> None:
        self._fh, self.sha, self.nbytes = fh, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), _CHUNK):
            chunk = view[i:i + _CHUNK]
            self.sha.update(chunk)
            self._fh.write(chunk)
        self.nbytes += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()


def _hash_file(path: Any) -> tuple[str, int]:
    """sha256 and size of a file just written (still in the page cache): mapped, not copied."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return hashlib.sha256().hexdigest(), 0
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return hashlib.sha256(mm).hexdigest(), size


def _recyclable(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
            and t.is_contiguous())


def _to_cpu_copy(obj: Any, free: dict | None = None, held: list | None = None) -> Any:
    """A CPU copy of ``obj``'s tensors (one memcpy each), into ``free`` buffers of the same dtype
    and shape where there are some (no fresh pages to fault in); copies made are added to ``held``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if held is None or not _recyclable(t):
            return t.to("cpu", copy=True)
        bufs = free.get((t.dtype, t.shape)) if free else None
        out = bufs.pop().copy_(t) if bufs else t.to("cpu", copy=True)
        held.append(out)
        return out
    if isinstance(obj, dict):
        out = obj.__class__() if obj.__class__ is not dict else {}
        for k, v in obj.items():
            out[k] = _to_cpu_copy(v, free, held)
        return out
    if isinstance(obj, list):
        return [_to_cpu_copy(v, free, held) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_cpu_copy(v, free, held) for v in obj)
    return copy.deepcopy(obj)


def _safetensors_writers() -> list[tuple[Any, str]]:
    """Every module attribute through which transformers / peft write safetensors files."""
    import importlib

    found = []
    for mod_name in ("safetensors.torch", "transformers.modeling_utils", "transformers.trainer",
                     "peft.peft_model", "peft.utils.save_and_load"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for attr in ("save_file", "safe_save_file"):
            if callable(getattr(mod, attr, None)):
                found.append((mod, attr))
    return found


class AsyncWriter:
    """One per rank: a queue of deferred writes, drained by a daemon thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._jobs: list[Callable[[], None]] = []
        self._held: list[torch.Tensor] = []  # the CPU copies the queued jobs write
        # The copies of the last snapshot written, reused by the next capture: copying into
        # memory already mapped is one memcpy, while fresh memory is first faulted in page by page.
        # Holds at most one snapshot's state (which, written, the old code freed and reallocated).
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.hashes: dict[str, tuple[str, int]] = {}  # path -> (sha256, bytes) of what we wrote
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_copy_s = 0.0

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Within this block, heavy writes are copied to memory and queued instead of written."""
        jobs, hashes, held = self._jobs, self.hashes, self._held
        with self._lock:
            free, self._free = self._free, {}
        real_st = {(m, a): getattr(m, a) for m, a in _safetensors_writers()}

        # Only the copy happens here; the writer thread serialises straight into the file,
        # hashing as it goes, at low priority and mostly without the interpreter lock.
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(f, (str, os.PathLike)):
                return _REAL_TORCH_SAVE(obj, f, *args, **kwargs)
            kept = _to_cpu_copy(obj, free, held)

            def job() -> None:
                with open(f, "wb") as fh:
                    out = _HashingFile(fh)
                    _REAL_TORCH_SAVE(kept, cast(IO[bytes], out), *args, **kwargs)
                hashes[str(f)] = (out.sha.hexdigest(), out.nbytes)
            jobs.append(job)
            return None

        def save_file(tensors: dict, filename: Any, metadata: Any = None) -> None:
            kept = _to_cpu_copy(tensors, free, held)

            def job() -> None:
                # safetensors writes the file from the tensors' memory (without the lock); building
                # it in memory first (``save``) would hold the lock for the whole copy.
                _REAL_SAVE_FILE(kept, filename, metadata=metadata)
                hashes[str(filename)] = _hash_file(filename)
            jobs.append(job)

        t0 = time.perf_counter()
        torch.save = save  # type: ignore[assignment]
        for m, a in real_st:
            setattr(m, a, save_file)
        try:
            yield
        finally:
            torch.save = _REAL_TORCH_SAVE  # type: ignore[assignment]
            for (m, a), fn in real_st.items():
                setattr(m, a, fn)
            self.last_copy_s = time.perf_counter() - t0

    def _recycle(self, held: list[torch.Tensor]) -> None:
        free: dict[tuple, list[torch.Tensor]] = {}
        for t in held:
            free.setdefault((t.dtype, t.shape), []).append(t)
        with self._lock:
            self._free = free

    def flush_async(self, folder: Path, then: Callable[[], None] | None = None) -> None:
        """Write what ``capture`` queued, mark this rank done, then run ``then`` (rank 0)."""
        self.wait()  # one snapshot in flight per rank
        jobs, self._jobs = self._jobs, []
        held, self._held = self._held, []

        def work() -> None:
            try:
                # Lowest CPU priority for this thread only (Linux schedules threads as tasks).
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, 19)
                cpus = os.environ.get(WRITER_CPUS_ENV)
                if cpus:
                    os.sched_setaffinity(me, {int(c) for c in cpus.split(",")})
                for job in jobs:
                    job()
                jobs.clear()
                self._recycle(held)  # written: the next capture may copy into them
                held.clear()
                (folder / f".done-rank-{self.rank}").write_text("ok")
                if then is not None:
                    then()
            except BaseException as exc:  # reported by wait(); training itself goes on
                self.error = exc

        self._thread = threading.Thread(target=work, daemon=True, name="snapshot-writer")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            print(f"snapshot write failed: {err!r}", flush=True)


def wait_for_ranks(folder: Path, ranks: range, timeout: float = 1800.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all((folder / f".done-rank-{r}").is_file() for r in ranks):
            for r in ranks:
                (folder / f".done-rank-{r}").unlink(missing_ok=True)
            return True
        time.sleep(0.05)
    return False
