"""How long an attempt holds its resources before its first step and after its last: the
planner's start-up and finish estimates.

Every attempt (launch, automatic restart, Slurm requeue, resume) pays it, and the budget bills it
(:mod:`workbench.runs.budget`), so a plan's time and cost show it apart from training:

    >>> startup_estimate(RunSpec(), params=7e9, rows=10_000, cached=False)["download"]  # doctest: +SKIP
    140.0

Basis of each phase (seconds; ``None`` where the input is unknown):

- ``python``: interpreter, torch, transformers, peft and the process group: 10 s, what an idle
  machine with a warm page cache takes; a cold cache or a loaded host is slower, several times
  so under heavy load (docs/planning.md).
- ``download``: the weights at 100 MB/s when not in the local Hugging Face cache (a cloud VM
  typically gets 50-200 MB/s from the Hub); 0 when cached or a local folder.
- ``load``: every rank on a node makes the weights ready in its own memory at the load dtype
  (float32 on CPU) at once, so the node spends ranks x parameters x bytes at the rate calibration
  measured (``workbench.plan.calibrate.measure_load``: a safetensors file read and converted into
  new memory), else 1 GB/s; at least the file read from local disk once at 1 GB/s (safetensors
  on NVMe reads 1-3 GB/s; the ranks share the page cache). Quantisation at load (QLoRA) doubles it.
- ``tokenise``: only where the ranks tokenise for themselves (launch could not load the tokenizer,
  so it did not tokenise once before submitting: workbench.data.tokenized); 300 rows/s, the
  rate of short chat rows such as the built-in tiny model's; long rows are slower: a floor. Give
  ``rows`` only then; the planner does not (ranks read the memory-mapped data in well under 1 s).
- ``strategy``: DDP set-up 2 s; DeepSpeed ZeRO engine creation 10 s (it builds its optimizer and
  partitions; ZeRO-3 partitions the weights too: 20 s). With several ranks, DDP and ZeRO-1/2 also
  pay for the weights once more: the wrap broadcasts every parameter, frozen ones too (torch's
  ``_sync_module_states``), from rank 0 at the link's rate (the GPU table's ``interconnect_gbps``).
  CPU ranks train the weights where they were loaded (workbench.train.arguments gives them the device
  ``cpu``: the Trainer's move to accelerate's ``cpu:N`` would copy every weight of every rank).
- ``first step``: on CPU, what the first step spends beyond the steady pace: its gradients and
  AdamW's two float32 states made in new memory at the load rate, on every rank of the node at
  once (a 0.5B full fine-tune: ~6 GB). Not counted on a GPU (the allocator's pages are the
  device's; its kernels' first calls are not modelled).

The finish (:func:`finish_estimate`) is what follows the last step besides the last validation
pass and the ``eval:`` scoring, which the plan times apart: the trained weights' save (the LoRA
adapter in float32, or the whole model at the dtype the ranks hold it in) at the rate calibration
measured (``measure_save``), else 0.5 GB/s, and the ranks' exit, EXIT_S.
"""

from __future__ import annotations

from pathlib import Path

from workbench.spec import RunSpec

PYTHON_S = 10.0
DOWNLOAD_BYTES_PER_S = 100e6
DISK_BYTES_PER_S = 1e9
LOAD_BYTES_PER_S = 1e9  # weights made ready in memory, uncalibrated
TOKENISE_ROWS_PER_S = 300.0
STRATEGY_S = {"ddp": 2.0, "zero1": 10.0, "zero2": 10.0, "zero3": 20.0}
SAVE_BYTES_PER_S = 0.5e9  # weights written by save_model, uncalibrated
# The ranks' exit and the supervisor's last write: a fraction of a second once the scoring and
# the last validation, which the plan times apart, are taken out (docs/planning.md).
EXIT_S = 0.3
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def _cached(spec: RunSpec) -> bool:
    """Are the weights on this machine already (a folder, a built-in, or the HF cache)?"""
    model_id = spec.model.id
    if model_id.startswith("builtin:") or Path(model_id).expanduser().is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "config.json", revision=spec.model.revision)
        return isinstance(hit, str)
    except Exception:  # no hub library or a malformed id: assume a download
        return False


def startup_estimate(spec: RunSpec, params: float | None = None, rows: int | None = None,
                     cached: bool | None = None, strategy: str | None = None,
                     python_s: float | None = None, *, load_dtype: str | None = None,
                     load_bytes_per_s: float | None = None, link_bytes_per_s: float | None = None,
                     trainable: float | None = None) -> dict[str, float | None]:
    """Seconds per start-up phase: python, download, load, tokenise, strategy, first step (see the
    module).

    ``params``: the model's parameter count (the planner knows it); ``rows``: training rows;
    ``cached``: whether the weights are local (None: look); ``strategy``: the resolved parallel
    strategy (None: the spec's, with ``auto`` taken as ddp); ``python_s``: a rank's start as
    calibration measured it on the target (workbench.plan.stepclock), else PYTHON_S;
    ``load_dtype``: what the ranks hold the weights in (None: the spec's dtype);
    ``load_bytes_per_s``: the target's measured load rate (else LOAD_BYTES_PER_S);
    ``link_bytes_per_s``: the ranks' link for DDP's broadcast (None: no broadcast counted);
    ``trainable``: the trained parameters (None: the first step's allocations not counted).
    """
    file_bytes = None if params is None else params * _BYTES_PER_PARAM.get(spec.model.dtype, 2)
    if cached is None:
        cached = _cached(spec)
    res = spec.resources
    ranks = res.gpus_per_node if res.gpus_per_node > 0 else res.procs_per_node
    held = None if params is None else _held_bytes(spec, params, load_dtype)
    rate = load_bytes_per_s or LOAD_BYTES_PER_S
    load = None if held is None or file_bytes is None else max(
        file_bytes / DISK_BYTES_PER_S, ranks * held / rate)
    if load is not None and spec.model.quantization != "none":
        load *= 2
    chosen = strategy or spec.parallel.strategy
    chosen = "ddp" if chosen == "auto" else chosen
    set_up = STRATEGY_S.get(chosen, 2.0)
    if held is not None and res.world_size > 1 and chosen != "zero3" and link_bytes_per_s:
        set_up += held / link_bytes_per_s  # the wrap's broadcast of every parameter
    return {
        "python": PYTHON_S if python_s is None else python_s,
        "download": 0.0 if cached else (None if file_bytes is None
                                        else file_bytes / DOWNLOAD_BYTES_PER_S),
        "load": load,
        # Only when the ranks tokenise for themselves (see the module docstring).
        "tokenise": None if rows is None else rows / TOKENISE_ROWS_PER_S,
        "strategy": set_up,
        "first step": _first_step(spec, held, trainable, ranks, rate),
    }


def _first_step(spec: RunSpec, held: float | None, trainable: float | None, ranks: int,
                rate: float) -> float | None:
    """A CPU rank's first step makes its gradients and AdamW's two fp32 states in new memory
    (the pages' faults, at the load rate), on every rank of the node at once."""
    if trainable is None or held is None or spec.resources.gpus_per_node > 0:
        return None
    return ranks * (_trained_bytes(spec, held, trainable) + trainable * 8) / rate


def _held_bytes(spec: RunSpec, params: float, load_dtype: str | None) -> float:
    """One rank's weights in memory, at the dtype it holds them in (None: the spec's)."""
    return params * _BYTES_PER_PARAM.get(load_dtype or spec.model.dtype, 2)


def _trained_bytes(spec: RunSpec, held: float, trainable: float) -> float:
    """The trained weights' bytes (their gradients', and what the finish saves): the whole model
    as held for full fine-tuning, else the adapters, which peft keeps in float32."""
    return held if spec.method.kind == "full" else trainable * 4


def finish_estimate(spec: RunSpec, params: float, trainable: float, *,
                    load_dtype: str | None = None, save_bytes_per_s: float | None = None) -> float:
    """Seconds from the last step to the end beside validation and scoring (see the module):
    ``params``/``trainable`` the model's and the trained parameters, ``load_dtype`` what the
    ranks hold the weights in, ``save_bytes_per_s`` the target's measured save rate."""
    saved = _trained_bytes(spec, _held_bytes(spec, params, load_dtype), trainable)
    return EXIT_S + saved / (save_bytes_per_s or SAVE_BYTES_PER_S)
