"""The sweep's Optuna study: which trial to try next, and whether a running one is clearly worse.

One study per sweep, in SQLite in the sweep directory, so any process (the detached controller,
a resumed one, the notebook reading results) loads the same trials. Every strategy goes through
the same ask/tell path; only the sampler differs: ``grid`` (GridSampler over the lists),
``random`` (RandomSampler) and ``optuna`` (TPESampler). The pruner (median by default) judges a
trial on the intermediate values of the objective reported at each evaluation step.

    >>> study = open_study(record, "optuna", params, "minimize", seed=0)   # doctest: +SKIP
    >>> trial = study.ask(); values = suggest(trial, params)               # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.errors import SweepError
from workbench.sweep.space import Param

if TYPE_CHECKING:
    import optuna

    from workbench.sweep.record import SweepRecord

STRATEGIES = ("grid", "random", "optuna")
PRUNERS = ("median", "none")


def _sampler(strategy: str, params: list[Param], seed: int | None) -> Any:
    import optuna

    if strategy == "grid":
        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, *args: Any, **kwargs: Any) -> None:
                # GridSampler calls Study.stop() once the grid is covered, which raises outside
                # Study.optimize(); the controller asks and tells itself and counts the trials.
                pass

        return Grid({p.path: p.grid_values() for p in params}, seed=seed)
    if strategy == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if strategy == "optuna":
        return optuna.samplers.TPESampler(seed=seed)
    raise SweepError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")


WARMUP_REPORTS = 1  # a trial's first evaluation is never judged


def _pruner(pruner: str, startup: int) -> Any:
    import optuna

    if pruner == "median":
        class AfterFirstReports(optuna.pruners.MedianPruner):
            # Optuna's n_warmup_steps counts steps, but evaluations fall at training steps (2, 4,
            # ... or 0 for one before training): the warm-up is counted in evaluation reports.
            def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
                if len(trial.intermediate_values) <= WARMUP_REPORTS:
                    return False
                return bool(super().prune(study, trial))

        # A trial is compared only once `startup` trials have completed, and never at its first
        # evaluation: one noisy early value is not "clearly worse".
        return AfterFirstReports(n_startup_trials=startup)
    if pruner == "none":
        return optuna.pruners.NopPruner()
    raise SweepError(f"pruner {pruner!r} is not one of {', '.join(PRUNERS)}")


def open_study(record: SweepRecord, strategy: str, params: list[Param], direction: str,
               seed: int | None = None, pruner: str = "median",
               prune_after: int = 2) -> optuna.Study:
    """Create the study (or load it again: the same name in the same file)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(storage=record.study_url, study_name="sweep",
                               sampler=_sampler(strategy, params, seed),
                               pruner=_pruner(pruner, prune_after),
                               direction="maximize" if direction == "maximize" else "minimize",
                               load_if_exists=True)


def suggest(trial: optuna.Trial, params: list[Param]) -> dict[str, Any]:
    """Ask ``trial`` for a value of every parameter (the sampler picks)."""
    out: dict[str, Any] = {}
    for p in params:
        if p.choices is not None:
            out[p.path] = trial.suggest_categorical(p.path, list(p.choices))
        elif p.is_int:
            out[p.path] = trial.suggest_int(p.path, int(p.low or 0), int(p.high or 0),
                                            step=int(p.step or 1), log=p.log)
        else:
            out[p.path] = trial.suggest_float(p.path, float(p.low or 0), float(p.high or 0),
                                              step=p.step, log=p.log)
    return out


def trial_of_frozen(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def trial_of(study: optuna.Study, number: int) -> optuna.Trial:
    """A live Trial for the study's trial ``number`` (e.g. in a resumed controller) to report to."""
    import optuna

    frozen = trial_of_frozen(study, number)
    # FrozenTrial keeps its storage id only as _trial_id; Trial(study, id) is how Optuna itself
    # rebuilds a trial to report to.
    return optuna.trial.Trial(study, frozen._trial_id)
