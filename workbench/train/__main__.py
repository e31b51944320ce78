"""``python -m workbench.train RUN_DIR``: the training entry point run by every rank on every node.

``python -m workbench.train --standby FOLDER`` is a rank of a standby start (see
:mod:`workbench.runs.standby`): it imports what training needs, waits for the go, then trains on the
run directory the go names.

``record`` writes an exception that ends a rank to torchelastic's error file, from which torchrun
hands the first failure (its type and message) to the supervisor as the run's error.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from workbench.train.preload import collector_off

    collector_off()  # until the imports are done (workbench.train.preload)

    from torch.distributed.elastic.multiprocessing.errors import record

    from workbench.train.run import main

    if len(sys.argv) == 3 and sys.argv[1] == "--standby":
        from workbench.runs.standby import await_go

        sys.exit(record(lambda folder: main(await_go(folder)))(sys.argv[2]))
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m workbench.train RUN_DIR | --standby FOLDER\n")
        sys.exit(2)
    sys.exit(record(main)(sys.argv[1]))
