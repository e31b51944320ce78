"""The course tests' users reach what they import wherever the clone lives (tests/course/reach.py).

Real Unix users made with useradd (removed after) run Python through runuser: a package in a
0700 temporary folder (what ``mktemp -d`` makes) is importable by them only while
:func:`reachable` holds, its folder stays unlistable, and every mode is back afterwards; the
students' interpreter (tests/course/conftest.py) imports what their Jupyter servers import.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.course.conftest import _students_python
from tests.course.reach import REPO, reachable


@pytest.fixture(scope="module")
def student() -> Iterator[str]:
    assert os.geteuid() == 0, "the course tests create Unix users: run them as root (CI does)"
    name = f"wbr{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "-s", "/bin/sh", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture(scope="module")
def students_python() -> Iterator[tuple[Path, dict[str, str]]]:
    """(the students' interpreter, the environment the hub's spawner gives it), in a 0755 root."""
    root = Path(tempfile.mkdtemp(prefix="wbreach-"))
    root.chmod(0o755)
    try:
        env = {"LD_LIBRARY_PATH": str(root / "python" / "lib")}
        yield _students_python(root), env
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_user(user: str, python: Path, env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    argv = ["runuser", "-u", user, "--", "env", "-i", "HOME=/", *(f"{k}={v}" for k, v in
                                                                  env.items()),
            str(python), "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd="/")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_package_in_a_0700_folder_is_importable_only_while_reachable(student, students_python,
                                                                       students_reach):
    # students_reach: the interpreter's own root must be reachable already, so that only the
    # package's folders are in question here.
    python, env = students_python
    outer = Path(tempfile.mkdtemp(prefix="wbreach-private-"))  # 0700, as mktemp -d makes it
    try:
        inner = outer / "clone"
        inner.mkdir(mode=0o700)
        inner.chmod(0o700)
        site = inner / "site"
        (site / "wb_reach_pkg").mkdir(parents=True)
        site.chmod(0o755)
        (site / "wb_reach_pkg").chmod(0o755)
        (site / "wb_reach_pkg" / "__init__.py").write_text("WHERE = __file__\n")
        (site / "wb_reach_pkg" / "__init__.py").chmod(0o644)
        env = {**env, "PYTHONPATH": str(site)}
        before = {p: _mode(p) for p in (outer, inner, site)}
        assert before[outer] == before[inner] == 0o700
        load = "import wb_reach_pkg; print(wb_reach_pkg.WHERE)"
        listing = f"import os; print(os.listdir({str(outer)!r}))"

        hidden = as_user(student, python, env, load)
        assert hidden.returncode != 0 and "wb_reach_pkg" in hidden.stderr, hidden
        with reachable([site]) as changed:
            assert {f for f, _ in changed} == {outer, inner}  # the only folders without o+x
            assert _mode(outer) == _mode(inner) == 0o701  # traverse, no read
            seen = as_user(student, python, env, load)
            assert seen.returncode == 0, seen.stderr
            assert seen.stdout.strip() == str(site / "wb_reach_pkg" / "__init__.py")
            looked = as_user(student, python, env, listing)
            assert looked.returncode != 0 and "PermissionError" in looked.stderr, looked
        assert {p: _mode(p) for p in before} == before
        again = as_user(student, python, env, load)
        assert again.returncode != 0 and "wb_reach_pkg" in again.stderr, again
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def test_modes_come_back_when_the_block_raises(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    with pytest.raises(RuntimeError, match="inside"), reachable([private]):
        assert _mode(private) == 0o701
        raise RuntimeError("inside")
    assert _mode(private) == 0o700


def test_the_students_interpreter_imports_what_their_servers_import(student, students_python,
                                                                    students_reach):
    # What c.Spawner.cmd runs (jupyterhub.singleuser) and the lab extension it loads, as a user
    # with no home of its own, from the 0755 root the hub fixture makes it in.
    python, env = students_python
    code = ("import jupyterhub.singleuser, workbench, workbench_lab; "
            "print(workbench.__file__, workbench_lab.__file__)")
    done = as_user(student, python, env, code)
    assert done.returncode == 0, done.stderr[-3000:]
    import workbench_lab

    # The very files this venv imports: this checkout's package (the editable install) and the
    # installed lab extension; the checkout's root itself is on no sys.path of theirs.
    assert done.stdout.split() == [str(REPO / "workbench" / "__init__.py"),
                                   workbench_lab.__file__]
