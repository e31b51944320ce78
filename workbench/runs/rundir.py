"""The run directory: one layout on every target, and the only channel between a run and its readers.

    RUN_DIR/spec.yaml      resolved RunSpec, written once
    RUN_DIR/plan.json      what the planner decided and why
    RUN_DIR/status.json    state machine, replaced atomically (tmp + rename)
    RUN_DIR/metrics.jsonl  one JSON object per line, appended by global rank 0 only
    RUN_DIR/data/          the prepared train/validation examples (chat messages or text)
    RUN_DIR/logs/          one file per rank, plus the supervisor's
    RUN_DIR/adapter/ | model/   final artefacts; RUN_DIR/tb/ TensorBoard events

Readers tolerate a partially written last line in metrics.jsonl: :class:`MetricsReader` only
consumes complete lines and remembers its byte offset, so polling costs only the new bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import WorkbenchError

if TYPE_CHECKING:  # the supervisor reads run directories without needing pydantic
    from workbench.spec import RunSpec

PENDING, QUEUED, RUNNING = "pending", "queued", "running"
SUCCEEDED, FAILED, CANCELLED, BUDGET_STOPPED = "succeeded", "failed", "cancelled", "budget_stopped"
PRUNED = "pruned"  # stopped by a sweep because its metric was clearly worse (workbench.sweep)
STATES = (PENDING, QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, BUDGET_STOPPED, PRUNED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, BUDGET_STOPPED, PRUNED})
# status.json's ``stop_request``: why a cancel was asked for. "prune" (written by a sweep just
# before it cancels a trial) makes the cancel end in PRUNED; otherwise a cancel ends CANCELLED.
PRUNE_REQUEST = "prune"


# status.json's ``cancel_requested``: when a cancel was first asked for. Once set, no attempt
# starts: the launch and resume paths refuse to submit, a supervisor exits before its ranks,
# and no later write clears it (only a resume, for a request that ended the previous attempt).
CANCEL_REQUESTED = "cancel_requested"


def cancelled_state(status: dict[str, Any]) -> str:
    """The terminal state of a run whose processes were stopped on request (see PRUNE_REQUEST)."""
    return PRUNED if status.get("stop_request") == PRUNE_REQUEST else CANCELLED


class RunDirError(WorkbenchError, ValueError):
    """A request reaches outside a run directory."""


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` (tmp + fsync + rename): a reader that polls for the file sees
    nothing or all of it, never an empty or half-written file."""
    # One temp name per call: threads of one process (snapshot, upload, callbacks) write the
    # same file concurrently, and a shared name would let one rename the other's half-written text.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}."
                         f"{os.urandom(4).hex()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str))


class RunDir:
    """Paths and small, safe reads and writes of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- paths ----------------------------------------------------------------------------------
    spec_file = property(lambda self: self.path / "spec.yaml")
    plan_file = property(lambda self: self.path / "plan.json")
    status_file = property(lambda self: self.path / "status.json")
    metrics_file = property(lambda self: self.path / "metrics.jsonl")
    data_dir = property(lambda self: self.path / "data")
    logs_dir = property(lambda self: self.path / "logs")
    adapter_dir = property(lambda self: self.path / "adapter")
    model_dir = property(lambda self: self.path / "model")
    tb_dir = property(lambda self: self.path / "tb")

    def create(self, spec: RunSpec) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=False)
        self.logs_dir.mkdir()
        self.data_dir.mkdir()
        self.spec_file.write_text(spec.to_yaml(), encoding="utf-8")
        self.write_status(state=PENDING, created=time.time())
        return self

    resume_file = property(lambda self: self.path / "resume.yaml")

    def spec(self) -> RunSpec:
        """The run's spec, with the changes a resume asked for (resume.yaml) applied on top.

        spec.yaml is written once; a resume with, say, a larger budget records only its changes.
        """
        from workbench.spec import RunSpec

        spec = RunSpec.from_yaml(self.spec_file)
        if self.resume_file.is_file():
            import yaml

            changes = yaml.safe_load(self.resume_file.read_text(encoding="utf-8")) or {}
            spec = spec.updated(**changes)
        return spec

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"state": PENDING}

    def write_status(self, **changes: Any) -> dict[str, Any]:
        """Merge ``changes`` into status.json (read-modify-replace, never a torn file).

        Several writers touch it (the supervisor, rank 0's callbacks, its snapshot and upload
        threads): an advisory lock around the read-modify-replace keeps any update from being lost.
        """
        return self.update_status(lambda status: status.update(changes))

    def update_status(self, change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
        """Apply ``change`` (which edits the dict in place) to status.json under the status lock,
        so a decision made on what it reads (e.g. "this attempt's processes are all gone") and
        the write that follows cannot interleave with another writer."""
        with (self.path / ".status.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            status = self.status() if self.status_file.exists() else {}
            change(status)
            status["updated"] = time.time()
            write_json_atomic(self.status_file, status)
        return status

    # -- cancel requests ------------------------------------------------------------------------
    def request_cancel(self, stop_request: str | None = None) -> dict[str, Any]:
        """Record that a cancel was asked for (the first request's time stands) and return the
        status. A run still ``pending`` (being prepared: no backend has it yet) ends here, as
        cancelled; the path that would submit it sees the request and refuses."""

        def ask(status: dict[str, Any]) -> None:
            status.setdefault(CANCEL_REQUESTED, time.time())
            if status.get("state", PENDING) in TERMINAL:
                return
            if stop_request:
                status["stop_request"] = stop_request
            if status.get("state", PENDING) == PENDING:
                status.update(state=cancelled_state(status), ended=time.time())

        return self.update_status(ask)

    def start_unless_cancelled(self, **changes: Any) -> bool:
        """Apply ``changes`` (the start of a submit, or of a supervisor) unless a cancel was asked
        for: then the run is recorded as ended (if it is not yet) and False says start nothing.
        One locked write, so a request is either seen here or made after this start was recorded
        (and then stops what started)."""
        started: list[bool] = []

        def start(status: dict[str, Any]) -> None:
            if status.get(CANCEL_REQUESTED) is None:
                status.update(changes)
                started.append(True)
            elif status.get("state", PENDING) not in TERMINAL:
                status.update(state=cancelled_state(status), ended=time.time())

        self.update_status(start)
        return bool(started)

    def forget_cancel(self) -> None:
        """Drop the request that ended the run (a resume calls this on an ended run, before its
        checks): only a cancel asked for after this stops the resumed attempt."""
        self.update_status(lambda status: status.pop(CANCEL_REQUESTED, None)
                           if status.get("state") in TERMINAL else None)

    @contextlib.contextmanager
    def attempt_lock(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Held by whoever starts an attempt (launch, resume) across its check and its submit;
        yields False when someone else holds it for ``wait_s`` seconds. Readers that would judge
        the run dead look here first: while it is held, a new supervisor is on its way."""
        deadline = time.monotonic() + wait_s
        with (self.path / ".attempt.lock").open("a") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.05)
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- metrics --------------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=float) + "\n"
        # One write() of a whole line: readers never see half a record except at the very end.
        with self.metrics_file.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()

    def metrics(self) -> list[dict[str, Any]]:
        return MetricsReader(self.metrics_file).read_new()

    # -- logs -----------------------------------------------------------------------------------
    def log_files(self) -> list[Path]:
        return sorted(self.logs_dir.glob("*.log")) if self.logs_dir.is_dir() else []

    def read_from(self, path: str, offset: int = 0) -> bytes:
        """Bytes of a file inside the run directory from ``offset`` (b"" while it does not exist).

        Backends serve readers through this, so a path that escapes the run directory is refused.
        """
        full = (self.path / path).resolve()
        if not full.is_relative_to(self.path.resolve()):
            raise RunDirError(f"{path!r} is outside the run directory {self.path}")
        try:
            with full.open("rb") as fh:
                fh.seek(offset)
                return fh.read()
        except FileNotFoundError:
            return b""

    def artefact_dir(self) -> Path | None:
        for d in (self.adapter_dir, self.model_dir):
            if d.is_dir():
                return d
        return None


class MetricsReader:
    """Incremental reader of a metrics.jsonl file, tolerant of a partially written last line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        return list(self._iter_new())

    def _iter_new(self) -> Iterator[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return  # nothing complete yet
        self.offset += end + 1
        for raw in chunk[: end + 1].splitlines():
            if not raw.strip():
                continue
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                # A line cut by a crash mid-write and later followed by others: skip it, keep going.
                continue
