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
