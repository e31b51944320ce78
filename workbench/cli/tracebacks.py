"""A Workbench error in IPython (a notebook, the Workbench kernel, the terminal shell): its message,
not a wall of library frames.

:func:`install` registers a handler for :class:`~workbench.errors.WorkbenchError` with the shell
(``set_custom_exc``). The cell still fails (the kernel reports an error, so "run all" stops there),
but what the front end shows is the error's type and message; the full traceback is a click away
in a collapsed block (HTML front ends), and ``%tb`` prints it. Every other exception shows as usual.
``import workbench`` installs it when a shell is running, and so does ``%load_ext workbench``.
"""

from __future__ import annotations

import html
import re
import sys
from typing import Any

from workbench.errors import WorkbenchError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def install(shell: Any) -> None:
    """Show Workbench errors in ``shell`` as their message (idempotent)."""
    if getattr(shell, "_workbench_tracebacks", False):
        return
    shell.set_custom_exc((WorkbenchError,), _handler)
    shell._workbench_tracebacks = True


def summary(exc: BaseException) -> list[str]:
    """What a reader sees of ``exc``: its type, then its message (one line per line)."""
    lines = str(exc).splitlines() or [""]
    return [f"{type(exc).__name__}: {lines[0]}", *lines[1:]]


def _handler(shell: Any, etype: type, value: BaseException, tb: Any,
             tb_offset: int | None = None) -> list[str]:
    # What %tb and %debug read, as IPython's own traceback display sets them.
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    full = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    try:
        from IPython.display import display

        display({"text/html": "<details><summary>full traceback</summary><pre>"
                              f"{html.escape(_ANSI.sub('', chr(10).join(full)))}</pre></details>",
                 "text/plain": "(the full traceback: %tb)"}, raw=True)
    except Exception:  # noqa: BLE001 - no display in this shell: the message is still shown
        pass
    stb = summary(value)
    shell._showtraceback(etype, value, stb)  # the kernel's error message, with this text
    return stb
