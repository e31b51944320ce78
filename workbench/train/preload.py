"""What a rank imports before it trains, with Python's cyclic garbage collector off meanwhile.

A rank imports torch, transformers, peft and datasets: about half a million long-lived objects
(modules, classes, functions). With the collector on, the allocations of those imports trigger
over a thousand collections, the full ones walking everything imported so far: about a fifth of
a rank's import CPU time (docs/benchmarks-data.md). So ``python -m workbench.train`` turns the
collector off before its first import, and :func:`imports_done`, called once the imports are
done (in a standby rank: before the go), moves every object alive then into the permanent
generation (``gc.freeze``) and turns the collector back on. Later collections, the Trainer's
``gc.collect()`` at the start of training among them, then walk only what training allocated
since. Nothing is freed later than it would be: a frozen object is one the imports keep alive for
the process's life anyway, reference counting still frees everything else at once, and the
collector is on for the whole of training.
"""

from __future__ import annotations

import gc

_before = 0  # collections made before collector_off (the interpreter's own start-up)
_done: str | None = None  # what the first imports_done() saw, for the rank's log


def _collections() -> int:
    return sum(s["collections"] for s in gc.get_stats())


def collector_off() -> None:
    """The first thing a rank process does: no collections while it imports."""
    global _before
    _before = _collections()
    gc.disable()


def import_training_libraries() -> None:
    """Import the libraries every rank's training needs (what a standby rank imports early)."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, Trainer  # noqa: F401  (lazy: import now)

    try:  # the Trainer's TensorBoard callback imports it (tracking.tensorboard, on by default)
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass


def imports_done() -> str:
    """Keep what the imports made out of every later collection, and collect again from now
    (once; a later call changes nothing). A line for the rank's log: the collections the
    imports met and the objects now kept out."""
    global _done
    if _done is None:
        collections = _collections() - _before
        gc.freeze()
        gc.enable()
        _done = (f"gc: {collections} collections during the imports, "
                 f"{gc.get_freeze_count()} objects kept out of later ones")
    return _done
