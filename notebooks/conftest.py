"""The notebooks run under nbval with the test session's own WORKBENCH_HOME, never ~/.workbench.

quickstart.ipynb is not collected here: tests/lab/test_browser.py runs it top to bottom in
JupyterLab, in the kernel `make lab` gives it, and fails on any error output (its own asserts
included), so nbval would only train it a second time.

tests/conftest.py makes that home when it is imported and puts it in os.environ, which every
kernel nbval starts inherits. A session that collects only notebooks/ would not import it, so
this file does: once per session whatever the order of the paths (Python imports a module once),
and the notebooks and the tests share one home when both are collected. The tests package is
reached through a folder holding only a link to it: the checkout's root stays off sys.path.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if "tests.conftest" not in sys.modules:
    _TESTS_ONLY = Path(tempfile.mkdtemp(prefix="workbench-tests-pkg-"))
    (_TESTS_ONLY / "tests").symlink_to(Path(__file__).resolve().parents[1] / "tests",
                                       target_is_directory=True)
    sys.path.append(str(_TESTS_ONLY))

import tests.conftest  # noqa: E402,F401  (sets WORKBENCH_HOME for the kernels)

collect_ignore = ["quickstart.ipynb"]
