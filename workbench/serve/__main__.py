"""``python -m workbench.serve --guard DIR ...``: the guard process (:mod:`workbench.serve.guard`)."""

import sys

from workbench.serve.guard import _guard_main

sys.exit(_guard_main(sys.argv[1:]))
