"""Asynchronous snapshots: training waits only for an in-memory copy, a thread writes the files.

The Trainer still decides *what* a checkpoint holds and in which format (so its own resume code
reads it back); while it "saves", its heavy writes (``torch.save`` of optimizer, scheduler and RNG
state, ``safetensors`` files of the weights or adapter) are intercepted: each object is copied to
CPU memory on the spot and written to disk by a background thread. Small JSON files are written
directly. When a rank's writes are done it drops a marker; rank 0's thread waits for the markers
of every rank on its node, then commits the snapshot (rename to step-N, manifest last, latest,
prune, upload) — exactly what the synchronous path does.

DeepSpeed checkpoints (ZeRO shards written by the engine) take the synchronous path.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_REAL_TORCH_SAVE = torch.save
_SAFETENSORS = __import__("safetensors.torch", fromlist=["save"])
_CHUNK = 8 << 20


def _write_hashed(data: bytes | memoryview, path: Any) -> tuple[str, int]:
    """Write bytes to ``path`` in chunks, hashing as we go (both release the interpreter lock)."""
    h = hashlib.sha256()
    view = memoryview(data)
    with open(path, "wb") as fh:
        for i in range(0, len(view), _CHUNK):
            chunk = view[i:i + _CHUNK]
            h.update(chunk)
            fh.write(chunk)
    return h.hexdigest(), len(view)


def _to_cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = obj.__class__() if obj.__class__ is not dict else {}
        for k, v in obj.items():
            out[k] = _to_cpu_copy(v)
        return out
    if isinstance(obj, list):
        return [_to_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_cpu_copy(v) for v in obj)
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
        self.hashes: dict[str, tuple[str, int]] = {}  # path -> (sha256, bytes) of what we wrote
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_copy_s = 0.0

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Within this block, heavy writes are copied to memory and queued instead of written."""
        jobs, hashes = self._jobs, self.hashes
        real_st = {(m, a): getattr(m, a) for m, a in _safetensors_writers()}

        # Serialising into memory is the only part that holds the interpreter lock; writing and
        # hashing the bytes happen at low priority without it, so training keeps running.
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(f, (str, os.PathLike)):
                return _REAL_TORCH_SAVE(obj, f, *args, **kwargs)
            held = _to_cpu_copy(obj)

            def job() -> None:
                buf = io.BytesIO()
                _REAL_TORCH_SAVE(held, buf, *args, **kwargs)
                hashes[str(f)] = _write_hashed(buf.getbuffer(), f)
            jobs.append(job)
            return None

        def save_file(tensors: dict, filename: Any, metadata: Any = None) -> None:
            held = _to_cpu_copy(tensors)

            def job() -> None:
                hashes[str(filename)] = _write_hashed(_SAFETENSORS.save(held, metadata=metadata),
                                                      filename)
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

    def flush_async(self, folder: Path, then: Callable[[], None] | None = None) -> None:
        """Write what ``capture`` queued, mark this rank done, then run ``then`` (rank 0)."""
        self.wait()  # one snapshot in flight per rank
        jobs, self._jobs = self._jobs, []

        def work() -> None:
            try:
                # Lowest CPU priority for this thread only (Linux schedules threads as tasks).
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                for job in jobs:
                    job()
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
