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


def test_no_folder_of_the_checkout_shadows_a_package_the_libraries_probe():
    # Where the checkout's root is on sys.path (PYTHONPATH, the bench, the tests, a kernel started
    # here, and every rank they start), a top-level folder is importable under its name. A
    # library probing an optional package of that name then finds it, and transformers, failing to
    # find its version, reads the RECORD of every installed distribution (packages_distributions:
    # ~0.3 CPU s per process importing transformers; `kernels/` did this to every rank).
    import importlib.util
    import re

    probed: set[str] = set()
    for module in ("transformers.utils.import_utils", "accelerate.utils.imports"):
        spec = importlib.util.find_spec(module)  # the source as text: nothing imported
        assert spec is not None and spec.origin is not None, module
        probed |= set(re.findall(r"_is_package_available\(\s*[\"']([\w.-]+)[\"']",
                                 Path(spec.origin).read_text(encoding="utf-8")))
    assert "torch" in probed and len(probed) > 50, sorted(probed)  # the pattern still finds them
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert not folders & probed, f"rename these top-level folders: {sorted(folders & probed)}"
