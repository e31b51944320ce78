"""``python -m workbench.train RUN_DIR``: the training entry point run by every rank on every node.

``record`` writes an exception that ends a rank to torchelastic's error file, from which torchrun
hands the first failure (its type and message) to the supervisor as the run's error.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from workbench.train.run import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m workbench.train RUN_DIR\n")
        sys.exit(2)
    sys.exit(record(main)(sys.argv[1]))
