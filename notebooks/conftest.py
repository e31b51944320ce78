"""The notebooks run under nbval with the test session's own WORKBENCH_HOME, never ~/.workbench.

tests/conftest.py makes that home when it is imported and puts it in os.environ, which every
kernel nbval starts inherits. A session that collects only notebooks/ would not import it, so
this file does: once per session whatever the order of the paths (Python imports a module once),
and the notebooks and the tests share one home when both are collected.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `pytest notebooks` from elsewhere than the checkout's root
    sys.path.insert(0, _ROOT)

import tests.conftest  # noqa: E402,F401  (sets WORKBENCH_HOME for the kernels)
