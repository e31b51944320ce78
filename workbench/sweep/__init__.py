"""Sweeps: try many settings of one RunSpec under one budget, stop the losers early.

    >>> s = workbench.sweep(spec, space={"train.lr": [1e-4, 1e-3]}, budget=50, concurrent=2)  # doctest: +SKIP
    >>> s.show()                                                                              # doctest: +SKIP

The modules, in the order the data moves: :mod:`~workbench.sweep.space` (what may vary),
:mod:`~workbench.sweep.start` (check and record a sweep), :mod:`~workbench.sweep.record` (the
sweep's directory and sweep.json), :mod:`~workbench.sweep.study` (Optuna: samplers, pruner),
:mod:`~workbench.sweep.runner` (the detached controller: price, launch, watch, prune, tell),
:mod:`~workbench.sweep.budget` (what the sweep spent and holds, what a trial is priced at),
:mod:`~workbench.sweep.objective` (the metric read from a trial's run), :mod:`~workbench.sweep.handle`
(the Sweep handle) and :mod:`~workbench.sweep.widget` (the live view).
"""

from workbench.sweep.handle import Sweep, get_sweep, sweeps
from workbench.sweep.start import sweep, sweep_yaml

__all__ = ["Sweep", "get_sweep", "sweep", "sweep_yaml", "sweeps"]
