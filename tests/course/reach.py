"""What the course tests' Unix users must reach: the checkout and the project venv's site-packages
(their Jupyter servers import jupyterhub, workbench and workbench_lab from there) and the temporary
folder that holds their interpreter, wherever those live. A clone in a folder other users cannot
traverse (``mktemp -d`` makes 0700 folders; /root is 0700) would hide them from the students, so
:func:`reachable` grants other users traverse permission (o+x, never read) on each folder from /
down to each path that lacks it, and puts every mode back as it was when it ends.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project_site() -> Path:
    """The project venv's site-packages (the students' interpreter adds it as a site dir)."""
    return next(Path(p) for p in sys.path if p.endswith("site-packages"))


def serving_site() -> Path | None:
    """The checkout's serving venv's site-packages (vLLM: `make serve-env`), if it has one."""
    return next((REPO / ".venv-serve" / "lib").glob("python*/site-packages"), None)


def students_imports() -> list[Path]:
    """The folders the students' processes read: this checkout (its package, through the editable
    install), the project
    venv's site-packages and Jupyter data (under sys.prefix), and the temporary folder the course
    fixtures make their interpreter and class in."""
    return [REPO, project_site(), Path(sys.prefix), Path(tempfile.gettempdir())]


def _folders_down_to(path: Path) -> list[Path]:
    """From / down to ``path``, along the path as written and along its symlinks' targets."""
    chains = [Path(os.path.abspath(path)), path.resolve()]
    return list(dict.fromkeys(p for c in chains for p in (*reversed(c.parents), c)))


@contextmanager
def reachable(paths: Iterable[Path]) -> Iterator[list[tuple[Path, int]]]:
    """Let other users traverse down to each of ``paths`` while the block runs.

    Yields the (folder, original mode) pairs it changed: only folders without o+x, each given
    o+x alone, so nothing becomes listable that was not. Every one gets its mode back at the end,
    also when the block raises. Needs to own the folders (the course tests run as root).
    """
    changed: list[tuple[Path, int]] = []
    try:
        for path in paths:
            for folder in _folders_down_to(path):
                mode = stat.S_IMODE(folder.stat().st_mode)
                if mode & stat.S_IXOTH:
                    continue
                try:
                    os.chmod(folder, mode | stat.S_IXOTH)
                except PermissionError as exc:
                    raise PermissionError(
                        f"cannot let other users traverse {folder} (mode {mode:o}), which the "
                        f"course tests' users must pass to reach {path}: run the tests as root "
                        "or move the checkout under a folder others can traverse") from exc
                changed.append((folder, mode))
        yield changed
    finally:
        for folder, mode in reversed(changed):
            os.chmod(folder, mode)
