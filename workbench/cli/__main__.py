"""``python -m workbench.cli ...``: the ``workbench`` command."""

import sys

from workbench.cli import main

sys.exit(main())
