"""The style guide's "ruff + mypy clean, no import cycles", kept true by the test command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "workbench", "tests", "bench")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing_in_the_package():
    out = _run("mypy", "workbench")
    assert out.returncode == 0, out.stdout + out.stderr


def _cycles(package: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run([sys.executable, str(ROOT / "tests" / "import_cycles.py"), package],
                          cwd=path, capture_output=True, text=True, timeout=300, env=env)


def test_no_import_cycles_in_the_package():
    out = _cycles("workbench", ROOT)
    assert out.returncode == 0 and not out.stdout, out.stdout + out.stderr


def test_the_cycle_check_counts_lazy_imports_and_skips_type_checking_ones(tmp_path):
    files = {
        "__init__.py": "",
        # A circle made only of an import inside a function: it counts.
        "jobs.py": "def deploy():\n    from pkg.serve import start\n    return start\n",
        "serve.py": "from pkg.jobs import deploy\n\n\ndef start():\n    return deploy\n",
        # A circle closed only under TYPE_CHECKING: it never runs, so it does not count.
        "spec.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.plan import Plan\n",
        "plan.py": "from pkg.spec import TYPE_CHECKING\n\n\nclass Plan:\n    pass\n",
        # A module importing the package that re-exports it: a circle through __init__.
        "room/__init__.py": "from pkg.room.door import knock\n\nKEY = 1\n",
        "room/door.py": "def knock():\n    from pkg.room import KEY\n    return KEY\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    out = _cycles("pkg", tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    circles = sorted(line for line in out.stdout.splitlines() if line.startswith("import circle"))
    assert circles == ["import circle in pkg: pkg.jobs -> pkg.serve -> pkg.jobs",
                       "import circle in pkg: pkg.room -> pkg.room.door -> pkg.room"], out.stdout
    # Each step names the import that makes it, so the circle can be cut where it is.
    assert "pkg.jobs -> pkg.serve  (line 2:" in out.stdout, out.stdout
    assert "from pkg.serve import start" in out.stdout, out.stdout


def test_the_cycle_check_refuses_a_folder_it_cannot_see(tmp_path):
    # A folder without __init__.py is a namespace package, which the import graph leaves out:
    # the circle below would go unreported if the check did not refuse the folder itself.
    files = {"__init__.py": "", "plan.py": "def f():\n    from pkg.train.run import g\n",
             "train/run.py": "from pkg.plan import f\n\n\ndef g():\n    return f\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    out = _cycles("pkg", tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pkg/train has Python modules but no __init__.py" in out.stdout, out.stdout


def test_the_checkouts_root_is_on_no_sys_path_so_kernels_is_not_importable():
    # With the checkout's root on sys.path, its top-level kernels/ folder (the kernelspec) is a
    # namespace package named like the hub's `kernels` library: transformers' probe finds it,
    # fails to read its version and reads the RECORD of every installed distribution (~0.3 CPU s
    # in every process importing transformers: each rank). Nothing may put the root there: not
    # pytest (importlib mode, run as its script), not the Pythons the tests and launches start.
    import importlib.util

    assert (ROOT / "kernels" / "workbench" / "kernel.json").is_file()
    assert ROOT not in [Path(p).resolve() for p in sys.path if p], sys.path
    # `kernels` may be installed (the hub's library); it must never resolve to our folder.
    ours = str(ROOT / "kernels")
    spec = importlib.util.find_spec("kernels")
    assert spec is None or ours not in list(spec.submodule_search_locations or []), spec
    # A Python started from the checkout's root, as the tests and a notebook server start them.
    out = subprocess.run([sys.executable, "-c", "import importlib.util; s = importlib.util."
                          "find_spec('kernels'); print(s and list(s.submodule_search_locations))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and ours not in out.stdout, out.stdout + out.stderr


def test_the_top_of_the_package_reads_as_the_architecture():
    # Issue 36's target: at most about twelve top-level modules and packages (the version file
    # and the asset folder are not rooms), each package saying in its docstring what it owns.
    pkg = ROOT / "workbench"
    rooms = sorted(p.name for p in pkg.iterdir()
                   if p.name not in {"__init__.py", "_version.py", "assets"} and (p.suffix == ".py"
                   or (p.is_dir() and (p / "__init__.py").exists())))
    assert len(rooms) <= 13, rooms
    for name in rooms:
        init = pkg / name / "__init__.py"
        if init.exists():
            assert init.read_text().lstrip().startswith('"""'), f"{name} says nothing of itself"
