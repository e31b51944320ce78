"""Process identity: record who runs a run, judge whether they are alive, and signal them safely.

A bare PID is not an identity: once a process ends, the kernel hands its number to the next one,
so a PID kept in a file (or in a job id) may name an unrelated process minutes later. A
:class:`ProcessIdentity` is ``{host, pid, create_time, role, rank}``; it is alive only while a
process with that PID exists on that host, started at that very time and is not a zombie, and it
is signalled only after that check (through psutil, which checks the start time again).

    >>> me = ProcessIdentity.me("supervisor")
    >>> me.alive()
    True

status.json holds the identities of the current attempt under ``processes`` (and ``attempt``, a
counter of supervisor starts): :func:`record` adds or replaces one, :func:`of_attempt` reads them
back. The same identity serves endpoints: record ``ProcessIdentity.of(popen.pid, "server")``
when starting a server, and stop it with :func:`terminate` (never ``os.kill`` on a stored PID).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import psutil

from workbench.runs.rundir import CANCEL_REQUESTED

if TYPE_CHECKING:
    from workbench.runs.rundir import RunDir

SUPERVISOR_ENV = "WORKBENCH_SUPERVISOR"  # "PID:CREATE_TIME" of the supervisor, for its ranks
_TIME_TOLERANCE_S = 0.01  # psutil derives create times from clock ticks: equal within a tick
# psutil adds the boot time from /proc/stat (whole seconds, re-read at every call) to a process's
# start ticks. When the wall clock is adjusted (NTP), that boot time moves by whole seconds, and
# with it every create time seen from then on.
_BOOT_TIME_SHIFT_S = 2


def same_start(seen: float, recorded: float) -> bool:
    """Do two create times (epoch seconds, as psutil reports them) name the same start? Equal
    within a clock tick, or apart by the whole seconds a moved boot time adds."""
    apart = abs(seen - recorded)
    return apart < _TIME_TOLERANCE_S or (
        apart <= _BOOT_TIME_SHIFT_S + _TIME_TOLERANCE_S
        and abs(apart - round(apart)) < _TIME_TOLERANCE_S)


def hostname() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, named so that PID reuse cannot be mistaken for it."""

    host: str
    pid: int
    create_time: float
    role: str  # "supervisor", "launcher", "rank", "server", ...
    rank: int | None = None

    @classmethod
    def of(cls, pid: int, role: str, rank: int | None = None) -> ProcessIdentity:
        """The identity of the live process ``pid`` on this host (psutil.NoSuchProcess if gone)."""
        return cls(hostname(), pid, psutil.Process(pid).create_time(), role, rank)

    @classmethod
    def me(cls, role: str, rank: int | None = None) -> ProcessIdentity:
        return cls.of(os.getpid(), role, rank)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessIdentity:
        return cls(str(data["host"]), int(data["pid"]), float(data["create_time"]),
                   str(data.get("role", "")), data.get("rank"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def token(self) -> str:
        """``PID:CREATE_TIME``, short enough for an environment variable (see SUPERVISOR_ENV)."""
        return f"{self.pid}:{self.create_time!r}"

    @property
    def here(self) -> bool:
        return self.host == hostname()

    def same(self, other: ProcessIdentity) -> bool:
        return (self.host, self.pid) == (other.host, other.pid) and same_start(
            self.create_time, other.create_time)

    def process(self) -> psutil.Process | None:
        """The live process this identity names, or None (ended, reused PID, zombie, elsewhere)."""
        if not self.here:
            return None
        try:
            proc = psutil.Process(self.pid)
            if not same_start(proc.create_time(), self.create_time):
                return None  # the PID now belongs to another process
            if proc.status() == psutil.STATUS_ZOMBIE:
                _reap(self.pid)
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def alive(self) -> bool:
        """True while this very process runs on this host. Raises for another host: ask there."""
        if not self.here:
            raise ValueError(f"{self.role} pid {self.pid} runs on {self.host}, not on "
                             f"{hostname()}: only that host can tell whether it is alive")
        return self.process() is not None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` if this identity is still alive; False (nothing sent) otherwise."""
        proc = self.process()
        if proc is None:
            return False
        try:
            proc.send_signal(sig)  # psutil re-checks the create time just before kill()
            return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def describe(self) -> str:
        who = self.role if self.rank is None else f"{self.role} {self.rank}"
        return f"{who} (pid {self.pid} on {self.host})"


def _reap(pid: int) -> None:
    # A zombie child of ours stays a zombie until waited for; others' zombies are their business.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# -- status.json -------------------------------------------------------------------------------
def of_attempt(status: dict[str, Any]) -> list[ProcessIdentity]:
    """The processes recorded for the run's current attempt."""
    return [ProcessIdentity.from_dict(p) for p in status.get("processes") or []]


def record(rd: RunDir, ident: ProcessIdentity) -> None:
    """Add ``ident`` to the current attempt, replacing an earlier process in the same place
    (same host, role and rank: e.g. the launcher of an automatic restart)."""

    def add(status: dict[str, Any]) -> None:
        keep = [p for p in status.get("processes") or []
                if (p.get("host"), p.get("role"), p.get("rank"))
                != (ident.host, ident.role, ident.rank)]
        status["processes"] = [*keep, ident.to_dict()]

    rd.update_status(add)


def start_attempt(rd: RunDir, supervisor: ProcessIdentity, **changes: Any) -> None:
    """Record ``supervisor`` as the start of a new attempt (unless it already is) with ``changes``.

    Called by whoever sees the supervisor first (the backend that started it, or the supervisor
    itself): the attempt counter moves once per supervisor, whichever of them writes first. Once a
    cancel was asked for, ``changes`` leave the state alone: a supervisor that saw the request
    first may have recorded the run's end already, and the request stands.
    """

    def start(status: dict[str, Any]) -> None:
        if not any(supervisor.same(p) for p in of_attempt(status)):
            status["attempt"] = int(status.get("attempt") or 0) + 1
            status["processes"] = [supervisor.to_dict()]
            status.update({k: v for k, v in changes.items()
                           if k != "state" or status.get(CANCEL_REQUESTED) is None})

    rd.update_status(start)


def alive_here(idents: Iterable[ProcessIdentity]) -> list[ProcessIdentity]:
    return [p for p in idents if p.here and p.alive()]


def elsewhere(idents: Iterable[ProcessIdentity]) -> list[ProcessIdentity]:
    return [p for p in idents if not p.here]


def terminate(idents: Iterable[ProcessIdentity], grace_s: float = 10.0) -> list[ProcessIdentity]:
    """SIGTERM each live identity (and its descendants), SIGKILL what is left after ``grace_s``;
    return the identities still alive after that (normally none)."""
    idents = list(idents)
    procs = _with_descendants(idents)
    for p in procs:
        _send(p, signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for p in left:
        _send(p, signal.SIGKILL)
    psutil.wait_procs(left, timeout=5.0)
    return [i for i in idents if i.here and i.alive()]


def kill_all(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Signal every process that is still the one psutil saw (a reused PID is left alone)."""
    for p in procs:
        _send(p, sig)


def _with_descendants(idents: Iterable[ProcessIdentity]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for ident in idents:
        proc = ident.process()
        if proc is None:
            continue
        found[proc.pid] = proc
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


# -- ranks end with their supervisor -------------------------------------------------------------
def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent ends (a no-op elsewhere).

    Meant for ``preexec_fn`` of a child (torchrun) whose parent (the supervisor) may be killed -9.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def watch_supervisor(interval_s: float = 1.0) -> threading.Thread | None:
    """In a rank: end this process when the supervisor (``$WORKBENCH_SUPERVISOR``) or the parent
    that started it (torchrun) is gone, e.g. after kill -9 or the OOM killer.

    torch starts each rank in a session of its own, so neither a signal to torchrun's process
    group nor the death of its parents reaches it: without this a rank would train on, unwatched.
    """
    token = os.environ.get(SUPERVISOR_ENV)
    watched: list[ProcessIdentity] = []
    if token:
        pid, created = token.split(":", 1)
        watched.append(ProcessIdentity(hostname(), int(pid), float(created), "supervisor"))
    parent = os.getppid()
    if parent > 1:
        try:
            watched.append(ProcessIdentity.of(parent, "launcher"))
        except psutil.NoSuchProcess:
            os._exit(1)
    if not watched:
        return None

    def watch() -> None:
        while True:
            for ident in watched:
                if not ident.alive():
                    print(f"workbench: the {ident.describe()} is gone; this rank stops",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="workbench-watchdog", daemon=True)
    thread.start()
    return thread
