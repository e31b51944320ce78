"""The seconds a run's own ``eval:`` scoring holds its resources, for the plan's clock and cost.

In the run, global rank 0 scores the live weights while every other rank waits at a barrier
(:mod:`workbench.evaluate.callback`), so each scoring pass is held and billed on every unit. A
pass is ``before`` (once), every ``every_steps`` (the last step is left to ``after``) and
``after``; per task (:mod:`workbench.evaluate.runner`):

- ``heldout``: the metric libraries' import, once in the run, and greedy generate of
  ``min(max_samples, examples)`` prompts in batches of the micro-batch (the callback's
  :class:`~workbench.evaluate.sources.TransformersSource`), up to ``max_new_tokens`` each; an
  answer may stop early, the plan counts the worst case;
- ``judge``: the same generation twice (the tuned answers and the base model's, with the adapter
  off or the base loaded), plus the judge's own answers, which an external endpoint gives and the
  plan cannot time;
- ``perplexity``: one forward pass per text (at most 1024 tokens), at most a prefill of the
  micro-batch scaled to the text's length (one text at a time);
- ``lm_eval``: not estimated (its tasks' sizes are the harness's), said by name.

The times come from the run's step measurement (:mod:`workbench.plan.stepclock`: a generate call
of the model timed at two new-token counts), else from FLOPs at the time basis's rate with
decoding assumed at :data:`DECODE_EFFICIENCY` of it (one token per sequence per forward pass is
memory-bound, not compute-bound); the line says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DECODE_EFFICIENCY = 0.1  # decoding's share of the training FLOPs rate, without a measurement
PERPLEXITY_MAX_TOKENS = 1024  # workbench.evaluate.perplexity.run's max_length
# heldout's first metrics call in a process (sacrebleu and rouge-score imported), when the run's
# step measurement has no figure for it (docs/planning.md).
METRICS_S = 1.5


@dataclass
class Scoring:
    """The plan's scoring: seconds over the whole run, passes, and what it says about them."""

    seconds: float = 0.0
    passes: int = 0
    line: str = ""
    not_estimated: list[str] = field(default_factory=list)


def passes(spec: Any, steps: int | None) -> tuple[int, bool]:
    """(scoring passes in the run, whether the count is known); ``every_steps`` needs ``steps``."""
    ev = spec.eval
    n = int(ev.before) + int(ev.after)
    if not ev.every_steps:
        return n, True
    if steps is None:
        return n, False
    during = steps // ev.every_steps
    if ev.after and steps % ev.every_steps == 0:
        during -= 1  # the callback leaves the last step to ``after``
    return n + during, True


def _count(task: Any, validation_rows: int | None) -> int | None:
    """Examples a heldout/judge/perplexity task scores: min(max_samples, the file's rows)."""
    rows: int | None = validation_rows
    if task.file:
        try:
            text = Path(task.file).expanduser().read_text(encoding="utf-8")
            rows = sum(1 for ln in text.splitlines() if ln.strip())
        except OSError:
            rows = None  # a file on the target only: max_samples bounds it
    if rows is None:
        return task.max_samples
    return rows if task.max_samples is None else min(rows, task.max_samples)


def _not_scored_in_run(spec: Any) -> str:
    """Why the run's trainer scores no ``eval:`` task in the run (only the text path has the
    scoring callback: workbench.spec.models.trainer_path), or "" when it does."""
    from workbench.spec.models import trainer_path

    try:
        path = trainer_path(spec, local_only=True)
    except Exception:  # noqa: BLE001 - a model this machine cannot read: the text path's plan
        path = "text"
    if path == "preference":
        return (f"a {spec.method.stage} run reports TRL's own validation metrics; its eval: "
                "tasks answer SFT prompts")
    return "an image model's run reports its validation loss only" if path == "vision" else ""


def scoring_seconds(spec: Any, shape: Any, m: Any, *, on_gpu: bool, gpu: Any,
                    prompt_tokens: float, validation_rows: int | None, steps: int | None,
                    example_tokens: float) -> Scoring:
    """The run's scoring, priced (see the module's docstring); ``m`` is the stored measurement of
    the run's step the planner looked up (a :class:`~workbench.plan.stepclock.StepMeasure`, or
    None), ``validation_rows`` the size of the validation split (None: unknown),
    ``prompt_tokens`` a prompt's length, ``example_tokens`` a whole example's (a perplexity
    text), ``gpu`` the time basis's GPU entry."""
    from workbench.plan.stepclock import rank_threads
    from workbench.plan.timing import _forward_flops_per_token

    ev = spec.eval
    n_pass, known = passes(spec, steps)
    if not ev.tasks or (n_pass == 0 and known):
        return Scoring(line="the run's own evaluation (eval:): none")
    unscored = _not_scored_in_run(spec)
    if unscored:
        return Scoring(line=f"the run's own evaluation (eval:): none in the run ({unscored}; "
                            "score it afterwards with job.evaluate())")
    if spec.parallel.strategy == "zero3":
        return Scoring(line="the run's own evaluation (eval:): none in the run (ZeRO-3 partitions "
                            "the weights; score afterwards with job.evaluate())")
    batch = spec.train.batch_size
    prompt = max(1.0, prompt_tokens)
    if m is not None and m.gen_prefill_s and m.gen_token_s:
        # Prefill is linear in the prompt's tokens, like the step in the example's.
        prefill, per_token = m.gen_prefill_s * prompt / m.seq, m.gen_token_s
        metrics = m.metrics_s or METRICS_S
        basis = (f"a generate call of this model measured here ({m.seq}-token prompts x {batch}: "
                 f"prefill {m.gen_prefill_s:.3g} s, {m.gen_token_s:.3g} s per new token)")
    else:
        cores = 1 if on_gpu else max(1, rank_threads(spec, on_gpu))
        rate = gpu.bf16_tflops * 1e12 * gpu.utilisation * cores
        per_seq_token = _forward_flops_per_token(shape, int(prompt))
        prefill = batch * prompt * per_seq_token / rate
        per_token = batch * per_seq_token / (rate * DECODE_EFFICIENCY)
        metrics = METRICS_S
        basis = (f"FLOPs at the clock's rate, decoding assumed at {DECODE_EFFICIENCY:.0%} of it "
                 "(no generate call measured: calibrate the target with this spec)")
    one_pass, parts, not_estimated = 0.0, [], []
    for task in ev.tasks:
        if task.kind == "lm_eval":
            not_estimated.append("lm_eval " + ", ".join(task.tasks))
            continue
        if task.file is None and validation_rows == 0:
            continue  # the callback skips a task that needs the (empty) validation split
        n = _count(task, validation_rows)
        if n is None:  # max_samples None and the size unknown
            not_estimated.append(f"{task.kind} (its number of examples is unknown: set "
                                 "max_samples)")
            continue
        if task.kind == "perplexity":
            secs = n * prefill * min(max(1.0, example_tokens), PERPLEXITY_MAX_TOKENS) / prompt
            parts.append(f"perplexity {n} texts")
        else:
            calls = math.ceil(n / batch) * (2 if task.kind == "judge" else 1)
            secs = calls * (prefill + task.max_new_tokens * per_token)
            parts.append(f"{task.kind} {n} prompts x {task.max_new_tokens} new tokens"
                         + (" x 2 (tuned and base answers; the judge's own time not counted)"
                            if task.kind == "judge" else ""))
        one_pass += secs
    total = one_pass * n_pass
    once = ""
    if n_pass and any(p.startswith("heldout") for p in parts):
        total += metrics  # once: rank 0 imports the metric libraries at its first pass
        once = f" + heldout's metrics {metrics:.2g} s once (their libraries' import)"
    line = (f"the run's own evaluation (eval:, rank 0 while the others wait, held and billed): "
            f"{total:.3g} s = "
            f"{n_pass} pass(es) x {one_pass:.3g} s ({'; '.join(parts) or 'nothing timed'}){once}"
            f", every answer at its full max_new_tokens (the worst case); from {basis}")
    if not known:
        line += "; every_steps passes not counted (the number of steps is unknown)"
    if not_estimated:
        line += "; not estimated: " + "; ".join(not_estimated)
    return Scoring(total, n_pass, line, not_estimated)


def validation_of(spec: Any, data: Any) -> tuple[int | None, float]:
    """(validation examples, prompt tokens) of the run's validation split: the examples the data
    estimate counted (scoring reads examples, not packed rows) and the prompts' p95 it measured
    (a batch pads to its longest), else a whole example's tokens (an over-count)."""
    tokens = data.tokens or {}
    val = (tokens.get("splits") or {}).get("validation")
    prompt = float(data.tokens_per_example)
    if val and (val.get("prompt_tokens") or {}).get("p95"):
        prompt = float(val["prompt_tokens"]["p95"])
    if val and not tokens.get("sampled") and val.get("examples") is not None:
        return int(val["examples"]), prompt
    return data.validation_examples, prompt
