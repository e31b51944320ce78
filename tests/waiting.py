"""Waiting on a condition with a deadline: what tests do instead of sleeping and asserting; and
whether a process is still alive (what most of those conditions ask)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """``cond()``'s first truthy value, polled every ``every`` seconds for up to ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def seen_stopped(process: Any, cond: Callable[[], Any]) -> Any:
    """``cond()`` asked while ``process`` (a ProcessIdentity) is stopped (SIGSTOP), so that what
    it sees cannot change by that process's hand before the caller acts on it. When ``cond()`` is
    truthy the process is left stopped (the caller kills it, or continues it with SIGCONT);
    otherwise it is continued. A process that is gone is not stopped: ``cond()`` is asked anyway.

    With :func:`wait_for`, it waits for a state of the record a process writes and acts on that
    state, not on a later one the process reached meanwhile (a kill that must land mid-sweep)."""
    import signal

    stopped = process.signal(signal.SIGSTOP)
    value = None
    try:
        value = cond()
        return value
    finally:
        if stopped and not value:
            process.signal(signal.SIGCONT)
