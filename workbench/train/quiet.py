"""Known third-party noise that says nothing to a workbench user, silenced where it is produced.

Each entry names one message of one library, matched as narrowly as the library allows, so a
new warning (or any error) still shows. ``install()`` is idempotent and cheap (it imports
neither library). ``import workbench`` calls it, so it covers the notebook kernel, the CLI and
every training rank (``python -m workbench.train`` imports the package first): rank logs stay
readable too.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# DeepSpeed's logger says this whenever it is imported on a machine without CUDA; training on
# CPU is a supported, deliberate choice here (resources.gpus_per_node: 0), not a failed probe.
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_MESSAGE = "Setting accelerator to CPU."

# peft asks every model whether it checkpoints activations through the old property name,
# and transformers 5 warns about it; neither our code nor the user's can change that call.
TRANSFORMERS_CHECKPOINTING_WARNING = r"`is_gradient_checkpointing` is deprecated"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    """Add the filters (once per process); safe to call before or after the libraries load."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)  # DeepSpeed reuses this logger object
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(DEEPSPEED_CPU_MESSAGE))
    warnings.filterwarnings("ignore", message=TRANSFORMERS_CHECKPOINTING_WARNING,
                            category=FutureWarning, module=r"transformers\.modeling_utils")


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Inside: datasets' and transformers' progress bars off ("Saving the dataset", "Writing
    model shards"), for steps that take a second and would print bars above a notebook's widgets.
    Each library's own switch is put back as it was."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets_off, hf_on = datasets.are_progress_bars_disabled(), hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not datasets_off:
            datasets.enable_progress_bars()
        if hf_on:
            hf_logging.enable_progress_bar()
