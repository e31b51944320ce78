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
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_REAL_TORCH_SAVE = torch.save
_REAL_SAFE_SAVE = __import__("safetensors.torch", fromlist=["save_file"]).save_file


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
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_copy_s = 0.0

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Within this block, heavy writes are copied to memory and queued instead of written."""
        jobs = self._jobs
        real_st = {(m, a): getattr(m, a) for m, a in _safetensors_writers()}

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(f, (str, os.PathLike)):
                return _REAL_TORCH_SAVE(obj, f, *args, **kwargs)
            held = _to_cpu_copy(obj)
            jobs.append(lambda: _REAL_TORCH_SAVE(held, f, *args, **kwargs))
            return None

        def save_file(tensors: dict, filename: Any, metadata: Any = None) -> None:
            held = _to_cpu_copy(tensors)
            jobs.append(lambda: _REAL_SAFE_SAVE(held, filename, metadata=metadata))

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
