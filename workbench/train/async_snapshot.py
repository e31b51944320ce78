"""Asynchronous snapshots: training does not wait for the files, and mostly not for the copy.

The Trainer still decides *what* a checkpoint holds and in which format (so its own resume code
reads it back); while it "saves", its heavy writes (``torch.save`` of optimizer, scheduler and RNG
state, ``safetensors`` files of the weights or adapter) are intercepted: each tensor gets a CPU
buffer to be copied into, and a background thread copies, then writes the files. Small JSON files
are written directly. When a rank's writes are done it drops a marker (or, when they failed, a
marker saying why); rank 0's thread waits for the markers of every rank of the world (the folder
is shared: a rank's files, its RNG state among them, are part of the snapshot), then commits the
snapshot (rename to step-N, manifest last, latest, prune, upload) — exactly what the synchronous
path does. A failure on any rank reaches rank 0's ``on_error`` (status.json), not only a log.

The copy is deferred, not taken on the spot: weights and optimizer state change only in the next
optimizer step, so the thread copies them while the next forward and backward pass run, and an
optimizer-step pre-hook holds that step until the copy is complete (``stall``). Tensors from
the GPU are copied on a side stream into pinned buffers. The buffers are the previous snapshot's
once it has been written. The contract this relies on: between the save and the next optimizer
step nothing changes the saved tensors in place (true of the Trainer's loop; DeepSpeed, whose
engine writes its own shards, takes the synchronous path).

After the copy, the writer thread (nice 19) serialises each file straight to disk, hashing as it
writes (no archive built in memory first), and mostly without the interpreter lock. All of this is
hidden where a host core is free for it (a GPU node); where training uses every core, its CPU time
comes out of training (see docs/benchmarks.md).

DeepSpeed checkpoints (ZeRO shards written by the engine) take the synchronous path.
"""

from __future__ import annotations

import contextlib
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

from workbench.runs.snapshots import SnapshotError

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


class _Copies:
    """One snapshot's tensors on one rank, each paired with the CPU buffer it is copied into.

    ``plan`` (during the Trainer's save) only hands out buffers; ``run`` (on the writer thread)
    copies; ``done`` is set once every buffer holds its value, or once the copy failed.
    """

    def __init__(self, free: dict[tuple, list[torch.Tensor]]) -> None:
        self.free = free
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live source, buffer)
        self.held: list[tuple[tuple, torch.Tensor]] = []  # (kind, buffer): recycled once written
        self.ready: dict[torch.device, Any] = {}  # per GPU: an event after the last update
        self.done = threading.Event()
        self.plan_s = 0.0  # training's time in the Trainer's save (and for the last writer)
        self.wait_s = 0.0  # training's time held at the next optimizer step

    @property
    def stall_s(self) -> float:
        return self.plan_s + self.wait_s

    def plan(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its buffer (to be filled by ``run``)."""
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if not _recyclable(t) or t.device.type not in ("cpu", "cuda"):
                return t.to("cpu", copy=True)  # rare (views, quantized, MPS...): on the spot
            kind = (t.dtype, t.shape, t.is_cuda)
            bufs = self.free.get(kind)
            buf = bufs.pop() if bufs else torch.empty(t.shape, dtype=t.dtype,
                                                      pin_memory=t.is_cuda)
            self.pairs.append((t, buf))
            self.held.append((kind, buf))
            return buf
        if isinstance(obj, dict):
            out = obj.__class__() if obj.__class__ is not dict else {}
            for k, v in obj.items():
                out[k] = self.plan(v)
            return out
        if isinstance(obj, list):
            return [self.plan(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.plan(v) for v in obj)
        return copy.deepcopy(obj)

    def mark_ready(self) -> None:
        """On each GPU, the point in the training stream the copies must wait for."""
        for dev in {src.device for src, _ in self.pairs if src.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            self.ready[dev] = event

    def run(self) -> None:
        streams = {}
        try:
            for dev, event in self.ready.items():  # GPU -> pinned host, beside the training
                streams[dev] = torch.cuda.Stream(device=dev)
                streams[dev].wait_event(event)
            for src, buf in self.pairs:
                if src.is_cuda:
                    with torch.cuda.stream(streams[src.device]):
                        buf.copy_(src, non_blocking=True)
                else:
                    buf.copy_(src)  # releases the interpreter lock
        finally:
            for stream in streams.values():  # (also after a failure: sources stay alive until
                stream.synchronize()         # the copies that read them have ended)
            self.pairs.clear()  # no references to live tensors kept
            self.done.set()


# Copies not yet complete, in any writer of this process; the next optimizer step waits for them.
_IN_FLIGHT: set[_Copies] = set()
_HOOKED: list[Any] = []


def _hold_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for copies in list(_IN_FLIGHT):
        if not copies.done.is_set():
            t0 = time.perf_counter()
            copies.done.wait()
            copies.wait_s += time.perf_counter() - t0


def _hook_optimizers() -> None:
    """Every optimizer step of this process first waits for the snapshot copies in flight."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(_hold_optimizer_step))


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
    """One per rank: the copies and the deferred writes of a snapshot, done by a daemon thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._jobs: list[Callable[[], None]] = []
        self.current: _Copies | None = None  # the snapshot last captured
        # The buffers of the last snapshot written, reused by the next capture: copying into
        # memory already mapped is one memcpy, while fresh memory is first faulted in page by page.
        # Holds at most one snapshot's state.
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.hashes: dict[str, tuple[str, int]] = {}  # path -> (sha256, bytes) of what we wrote
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        _hook_optimizers()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Within this block, heavy writes are given buffers and queued instead of written;
        ``flush_async`` then copies and writes them."""
        with self._lock:
            free, self._free = self._free, {}
        copies = self.current = _Copies(free)
        jobs: list[Callable[[], None]] = []
        self._jobs, hashes = jobs, self.hashes
        real_st = {(m, a): getattr(m, a) for m, a in _safetensors_writers()}

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(f, (str, os.PathLike)):
                return _REAL_TORCH_SAVE(obj, f, *args, **kwargs)
            kept = copies.plan(obj)

            def job() -> None:
                with open(f, "wb") as fh:
                    out = _HashingFile(fh)
                    _REAL_TORCH_SAVE(kept, cast(IO[bytes], out), *args, **kwargs)
                hashes[str(f)] = (out.sha.hexdigest(), out.nbytes)
            jobs.append(job)
            return None

        def save_file(tensors: dict, filename: Any, metadata: Any = None) -> None:
            kept = copies.plan(tensors)

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
            copies.mark_ready()
            copies.plan_s = time.perf_counter() - t0

    def _recycle(self, held: list[tuple[tuple, torch.Tensor]]) -> None:
        free: dict[tuple, list[torch.Tensor]] = {}
        for kind, buf in held:
            free.setdefault(kind, []).append(buf)
        with self._lock:
            self._free = free

    def flush_async(self, folder: Path, then: Callable[[], None] | None = None,
                    on_error: Callable[[BaseException], None] | None = None) -> None:
        """Copy and write what ``capture`` queued, mark this rank done, then run ``then``.

        If that fails, this rank's marker says why (for rank 0's ``wait_for_ranks``) and
        ``on_error`` gets the exception."""
        t0 = time.perf_counter()
        self.wait()  # one snapshot in flight per rank
        jobs, self._jobs = self._jobs, []
        copies = self.current or _Copies({})
        copies.plan_s += time.perf_counter() - t0
        _IN_FLIGHT.add(copies)

        def work() -> None:
            written = False
            try:
                me = threading.get_native_id()
                cpus = os.environ.get(WRITER_CPUS_ENV)
                if cpus:
                    os.sched_setaffinity(me, {int(c) for c in cpus.split(",")})
                copies.run()  # at normal priority: the next optimizer step may be waiting
                # Then the lowest CPU priority, for this thread only (Linux threads are tasks).
                os.setpriority(os.PRIO_PROCESS, me, 19)
                for job in jobs:
                    job()
                jobs.clear()
                self._recycle(copies.held)  # written: the next capture may copy into them
                (folder / f".done-rank-{self.rank}").write_text("ok")
                written = True
                if then is not None:
                    then()
            except BaseException as exc:  # reported by wait(); training itself goes on
                self.error = exc
                if not written:
                    with contextlib.suppress(OSError):  # the folder itself may be what failed
                        (folder / f".failed-rank-{self.rank}").write_text(f"{exc!r}")
                if on_error is not None:
                    with contextlib.suppress(Exception):
                        on_error(exc)
            finally:
                copies.done.set()  # (already, unless the thread failed before copying)
                _IN_FLIGHT.discard(copies)

        self._thread = threading.Thread(target=work, daemon=True, name="snapshot-writer")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            print(f"snapshot write failed: {err!r}", flush=True)


def wait_for_ranks(folder: Path, ranks: range, timeout: float = 1800.0) -> None:
    """Return once every rank in ``ranks`` has written its part of ``folder``; raise
    SnapshotError as soon as one says it could not, or when ``timeout`` passes."""
    deadline = time.time() + timeout
    while True:
        for r in ranks:
            failed = folder / f".failed-rank-{r}"
            if failed.is_file():
                raise SnapshotError(f"rank {r} could not write its part of {folder.name}: "
                                    f"{failed.read_text(errors='replace')}")
        missing = [r for r in ranks if not (folder / f".done-rank-{r}").is_file()]
        if not missing:
            for r in ranks:
                (folder / f".done-rank-{r}").unlink(missing_ok=True)
            return
        if time.time() >= deadline:
            raise SnapshotError(
                f"rank(s) {', '.join(map(str, missing))} did not finish writing {folder.name} "
                f"within {timeout:.0f} s; their logs (logs/rank-N.log) say why. Nodes must "
                "share the run directory for their ranks' parts to reach it")
        time.sleep(0.05)
