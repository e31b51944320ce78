"""``python -m workbench.train RUN_DIR``: the training entry point run by every rank on every node."""

from __future__ import annotations

import sys

from workbench.train.run import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m workbench.train RUN_DIR\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
