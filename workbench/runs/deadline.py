"""Work on this machine that ends where what it holds ends.

An evaluation or an export paid from a wallet holds a fixed time (``eval_hold_minutes``) and is
charged by the second, at most that hold. :func:`stop_at` ends such work in the calling process
when its time is up: a timer interrupts the main thread as Ctrl-C would (generation, a
subprocess or a server the work waits on), and the interruption leaves as the caller's typed
error, saying what stopped it and how to allow more. Work started from another thread is not
interrupted (only the main thread can be); it is charged its hold all the same.
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from workbench.errors import WorkbenchError

MARGIN_S = 1.0  # stopped this long before the hold ends, so the charge stays inside it


@contextmanager
def stop_at(seconds: float | None, error: type[WorkbenchError], message: str) -> Iterator[None]:
    """Run the body for at most ``seconds`` (None: no limit); past it, raise ``error(message)``."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident or 0
    guard = threading.Lock()
    state = {"running": True, "fired": False}

    def fire() -> None:
        with guard:
            if state["running"]:
                state["fired"] = True
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    # A real SIGINT: it also ends a wait the main thread is blocked in (a lock,
                    # a socket), which interrupt_main's flag alone would not.
                    signal.pthread_kill(main, signal.SIGINT)
                else:
                    _thread.interrupt_main()

    timer = threading.Timer(max(0.0, seconds - MARGIN_S), fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if state["fired"]:
            raise error(message) from None
        raise
    finally:
        with guard:
            state["running"] = False
        timer.cancel()
