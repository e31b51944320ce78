"""Time: how many training examples and tokens a run sees, and how long one optimizer step takes.

:func:`estimate_data` counts the data sources and measures tokens per example on a sample with
the model's own tokenizer and chat template (the same code that tokenises the run, so truncation
and dropped examples show before launch; what it reads: :mod:`workbench.plan.data_sample`);
where that tokenizer cannot be loaded here it falls back to a characters-per-token guess.
:func:`step_seconds` turns a strategy's FLOPs, gradient communication and offload copies into
seconds per step at the GPU type's assumed utilisation. The plan prices these hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workbench.plan.data_sample import (
    CHARS_PER_TOKEN,
    TEMPLATE_TOKENS,
    source_rows,
    text_chars,
    token_sample,
)
from workbench.plan.memory import Strategy, _Setup
from workbench.plan.shape import ModelShape
from workbench.spec import RunSpec
from workbench.targets.gpus import GpuType

_GUESS_ROOM = 1.5  # a character-based length guess, scaled up for sizing memory by it


@dataclass
class DataEstimate:
    rows: int | None  # training rows after the validation split; None when unknown
    tokens_per_example: float  # average tokens one example costs (padding included)
    note: str
    tokens: dict[str, Any] | None = None  # token statistics of the sample (TokenStats.to_dict)
    # The longest training example measured (tokens, at most max_length): the longest batch the
    # data can produce, which activations are sized by. None: unknown, or packed (max_length).
    longest: int | None = None
    longest_of: str = ""  # what it was measured on, for the plan to say
    # Examples in the validation split (not packed rows: scoring reads examples); None: unknown.
    validation_examples: int | None = None


def estimate_data(spec: RunSpec) -> DataEstimate:
    total: int | None = 0
    sample: list[dict[str, Any]] = []
    unknown = []
    for src in spec.data.sources:
        count, rows = source_rows(src.path)
        if count is None:
            unknown.append(src.path)
        else:
            if src.max_rows is not None:
                count = min(count, src.max_rows)
            total = (total or 0) + count
        sample += rows
    raw = None if unknown else total  # every row, before the validation split
    if unknown:
        total = None
    elif total is not None:
        total = max(1, int(total * (1 - spec.data.validation_fraction)))
    L = spec.data.max_length
    sample_stats, unread = token_sample(spec)
    train = sample_stats.splits.get("train") if sample_stats is not None else None
    measured = train is not None and train.kept > 0
    if train is not None and measured:
        lengths = [min(L, n) for n in train.lengths]
        if not lengths and train.tokens:
            # Stats from the tokenised-data cache (a run prepared this data) keep no per-example
            # lengths: a padded batch's longest is about the p95 (one example: the median).
            n = train.tokens["p95" if spec.train.batch_size > 1 else "median"]
            lengths = [min(L, n)] * train.kept
        whole = sample_stats is not None and sample_stats.fingerprint
        rows_of = (f"all {train.examples} rows (tokenised before)" if whole
                   else f"{train.examples} sampled rows")
        how = (f"measured with the model's tokenizer on {rows_of} "
               f"({train.truncated} truncated, {train.dropped} dropped at max_length {L})")
        if total is not None and train.dropped:
            total = max(1, int(total * train.kept / train.examples))
    else:
        lengths = [min(L, text_chars(r) / CHARS_PER_TOKEN + TEMPLATE_TOKENS) for r in sample]
        how = f"estimated from {len(lengths)} sampled rows at {CHARS_PER_TOKEN} characters per token"
    per_example: float
    packed_rows = _packed_rows(lengths, L) if spec.data.packing and lengths else []
    if packed_rows:
        # Rows hold whole examples only (workbench.data.tokenize.pack), laid end to end without
        # padding: a row costs the tokens it holds, short of max_length by the example that did
        # not fit.
        per_example = sum(packed_rows) / len(packed_rows)
        note = (f"packed: whole examples into rows of at most {L} tokens, ~{per_example:.0f} "
                f"tokens per row, {how}")
    elif spec.data.packing:
        per_example = L
        note = "packed and the data could not be sampled: assumed max_length tokens per row"
    elif lengths:
        # Each batch is padded to its longest example: average the per-batch maximum.
        bs = spec.train.batch_size
        batches = [lengths[i:i + bs] for i in range(0, len(lengths), bs)]
        per_example = sum(max(b_) for b_ in batches) / len(batches)
        note = f"not packed: ~{per_example:.0f} tokens per example after padding, {how}"
    else:
        per_example = L
        note = "not packed and the data could not be sampled: assumed max_length per example"
    if unread:
        note += f"; reading it failed: {unread}"
    if unknown:
        note += f"; row count unknown for {', '.join(unknown)} (set train.max_steps)"
    if packed_rows and total is not None:
        total = max(1, round(total * len(packed_rows) / len(lengths)))
        note += f"; ~{total:,} packed rows"
    # Statistics with a fingerprint are a whole tokenised set's (from the cache), not a sample.
    tokens = ({**sample_stats.to_dict(), "sampled": sample_stats.fingerprint is None}
              if measured else None)
    longest, longest_of = None, ""
    if measured and train is not None and not spec.data.packing:
        if train.lengths:
            longest = min(L, max(train.lengths))
            every = total is not None and train.examples >= total
            longest_of = (f"every training row ({train.examples:,})" if every else
                          f"the first {train.examples:,} rows; launch re-checks every row")
        elif (train.tokens or {}).get("max"):  # the prepared data's statistics: every row
            longest, longest_of = min(L, int(train.tokens["max"])), "every training row"
    elif lengths and not spec.data.packing:
        # Lengths guessed from characters: a tokenizer that splits finer (code, other scripts)
        # makes more tokens, so the guess gets room for half as many again.
        longest = min(L, math.ceil(max(lengths) * _GUESS_ROOM))
        longest_of = (f"{len(lengths)} sampled rows estimated at {CHARS_PER_TOKEN} characters per "
                      f"token, x{_GUESS_ROOM}")
    return DataEstimate(total, per_example, note, tokens, longest, longest_of,
                        _validation_examples(spec, raw, sample_stats))


def _validation_examples(spec: RunSpec, raw: int | None, stats: Any) -> int | None:
    """Examples the validation split will hold: the split is by content hash, so the sample's
    share of validation examples (exact when the sample read every row), else the fraction."""
    vf = spec.data.validation_fraction
    if vf <= 0:
        return 0
    if raw is None:
        return None
    splits = stats.splits if stats is not None else {}
    val, train = splits.get("validation"), splits.get("train")
    seen = (val.examples if val else 0) + (train.examples if train else 0)
    share = (val.examples if val else 0) / seen if seen else vf
    return round(raw * share)


def _packed_rows(lengths: list[float], block: int) -> list[float]:
    """Tokens per row when ``lengths`` are packed in order, as workbench.data.tokenize.pack does:
    an example that does not fit in the current row starts the next one."""
    rows: list[float] = []
    row = 0.0
    for n in lengths:
        if row and row + n > block:
            rows.append(row)
            row = 0.0
        row += n
    if row:
        rows.append(row)
    return rows


def step_rows(rows: int, batch_size: int, grad_accum: int, world: int) -> tuple[float, int]:
    """(training rows one optimizer step really carries, all ranks, averaged over an epoch;
    optimizer steps per epoch) for ``rows`` training rows, as the Trainer's data loader deals them.

    The Trainer batches the rows ``batch_size`` at a time, the last batch short, and keeps it
    (dataloader_drop_last is off). One process trains on those batches as they are: a split of 3
    rows at batch_size 8 makes steps of 3 rows. Several processes get the batches dealt round-robin
    by accelerate's BatchSamplerShard, which with even_batches (the Trainer's default) completes
    the short batch, and the deal, with rows from the epoch's start: every rank's batch is full,
    rows repeated (3 rows at batch_size 8 on 2 ranks: steps of 16 rows). Steps per epoch are the
    rank's batches over grad_accum, rounded up (transformers >= 5: the last step accumulates fewer).
    """
    batches = math.ceil(rows / batch_size)
    if world > 1:
        per_rank = math.ceil(batches / world)
        epoch_rows = per_rank * world * batch_size
    else:
        per_rank, epoch_rows = batches, rows
    per_epoch = max(1, math.ceil(per_rank / grad_accum))
    return epoch_rows / per_epoch, per_epoch


def _forward_flops_per_token(sh: ModelShape, seq_len: int) -> float:
    # 2 FLOPs per multiply-add of every linear layer (lm_head included), plus attention scores and
    # their weighting, 2·n_layer·n_ctx·d (Kaplan et al. 2020, table 1; causal masking halves the
    # 4·n_ctx·d of QK^T + AV).
    return 2 * (sh.linear_weights + sh.lm_head_weights) + 2 * sh.layers * seq_len * sh.hidden


# QLoRA dequantises every 4-bit weight to the compute dtype before each matmul that uses it
# (bitsandbytes' MatMul4Bit: forward, backward, and the recomputed forward under checkpointing):
# per weight and pass it reads 0.5 B, writes 2 B and the matmul reads those 2 B again, at the
# card's memory bandwidth. Memory-bound, so it weighs most on small micro-batches (Google
# Cloud's Vertex AI guidance, "LoRA is about 66% faster than QLoRA", is of such runs) and little
# at 4,096 tokens (torchtune measured QLoRA at 0.78x LoRA's tokens/s there: docs/planning.md).
_DEQUANT_BYTES_PER_WEIGHT = 4.5
_INTER_NODE_GBPS = 12.5  # 100 Gb/s InfiniBand/RoCE, the common cluster fabric
_PCIE_GBPS = 16.0  # effective host<->device copy bandwidth (PCIe 4.0 x16 pinned)
_CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPUAdam on a many-core host (ZeRO-Offload paper)
# The optimizer step without offload (gradient clipping, AdamW, zero_grad) streams ~7 fp32 values
# per trainable parameter through memory: a memory-bound cost FLOPs miss, which dominates full
# fine-tuning of small batches. Uncalibrated: ~1 TB/s effective on a datacenter card; on a CPU
# host 1.5e7 parameters/s per core, about what torch AdamW reaches (docs/planning.md). A
# calibration measures it (workbench.plan.calibrate.measure_optimizer).
_GPU_OPTIMIZER_PARAMS_PER_S = 3e10
_CPU_OPTIMIZER_PARAMS_PER_S_PER_CORE = 1.5e7
_ADAMW_STEP_BYTES = 7 * 4  # what the rates above stream per parameter


def _optimizer_step_bytes(s: _Setup, st: Strategy) -> float:
    """Bytes one parameter's update streams: AdamW's ~7 fp32 values; bitsandbytes' 8-bit AdamW
    reads the gradient, reads and writes the parameter and its two 1-byte moments."""
    if st.optimizer == "adamw":
        return _ADAMW_STEP_BYTES
    # peft keeps adapters fp32; a full fine-tune's weights are what it loads, or bf16 without
    # master weights.
    param = (s.compute_bytes if st.weights_16bit else s.load_bytes) if st.method == "full" else 4
    return 3 * param + 4


def paging_seconds(spill_gib: float) -> float:
    """Seconds per step a paged optimizer spends moving ``spill_gib`` of states that do not fit
    on the card (workbench.plan.memory.paged_spill_gib) in and out of host RAM: PCIe is full
    duplex, so the pages evicted go out while the pages needed come in."""
    return spill_gib * 2**30 / (_PCIE_GBPS * 1e9)


@dataclass(frozen=True)
class _Run:
    tokens_per_step: int  # processed tokens (padding included) per optimizer step, all ranks
    steps: int | None
    gpu: GpuType
    n_devices: int  # GPUs in total, or CPU cores in total for CPU runs
    on_gpu: bool
    # Trainable parameters per second through the optimizer step, per GPU or per host (all its
    # cores): the target's calibration, None for the uncalibrated default.
    optimizer_params_per_s: float | None = None


def step_seconds(s: _Setup, st: Strategy, r: _Run) -> tuple[float, float]:
    """(seconds per optimizer step, FLOPs per step) at the GPU type's assumed utilisation."""
    sh = s.shape
    fwd = _forward_flops_per_token(sh, s.seq_len)
    lora = sh.lora_params(s.lora_r, s.targets)
    # Full: backward = 2x forward (gradients for activations and for weights). LoRA: frozen
    # weights need no weight gradient, so backward computes only activation gradients.
    per_token = 3 * fwd if st.method == "full" else 2 * fwd + 6 * lora
    if s.checkpointing:
        per_token += fwd  # one more forward to recompute
    flops = per_token * r.tokens_per_step
    peak = r.gpu.bf16_tflops * 1e12 * r.n_devices * r.gpu.utilisation
    seconds = flops / peak
    passes = 3 if s.checkpointing else 2  # forward, backward (+ the recomputed forward)
    micro_batches = max(1, r.tokens_per_step / max(1, s.micro_batch * s.seq_len * s.world))
    if st.method == "qlora" and r.on_gpu:
        seconds += (micro_batches * passes * sh.linear_weights * _DEQUANT_BYTES_PER_WEIGHT
                    / (r.gpu.memory_gbps * 1e9))
    # Gradient all-reduce (ring: 2(n-1)/n of the gradient bytes), half hidden behind backward.
    # ZeRO-3 reduce-scatters the gradients (half of that) and all-gathers every 16-bit weight for
    # each pass ((n-1)/n of them): 1.5x the all-reduce for full fine-tuning without
    # checkpointing (ZeRO paper, sec. 7); the frozen base of LoRA is gathered too.
    t = sh.params if st.method == "full" else lora
    if s.world > 1:
        bw = (_INTER_NODE_GBPS if s.nodes > 1 else r.gpu.interconnect_gbps) * 1e9
        share = (s.world - 1) / s.world
        if st.parallel == "zero3":
            comm = share * (t + passes * sh.params * micro_batches) * s.compute_bytes / bw
        else:
            comm = 2 * share * t * s.compute_bytes / bw
        seconds += 0.5 * comm
    if st.offload_optimizer and r.on_gpu:
        seconds += t / s.world / _CPU_ADAM_PARAMS_PER_S + 2 * 4 * t / s.world / (_PCIE_GBPS * 1e9)
    elif r.on_gpu:
        # Counted whole on every card: ZeRO-1/2's sharded update is not taken as cheaper
        # (unmeasured: its bucketing and gathers cost too), so the choice among them is unchanged.
        seconds += (t / (r.optimizer_params_per_s or _GPU_OPTIMIZER_PARAMS_PER_S)
                    * _optimizer_step_bytes(s, st) / _ADAMW_STEP_BYTES)
    else:
        # A CPU host's ranks share its memory bandwidth: each updates every trainable parameter
        # (offloading to the same host changes nothing).
        per_node = r.n_devices / max(1, s.nodes)
        rate = r.optimizer_params_per_s or _CPU_OPTIMIZER_PARAMS_PER_S_PER_CORE * per_node
        seconds += t * (s.world / max(1, s.nodes)) / rate
    if st.offload_params:
        seconds += 2 * s.compute_bytes * sh.params / s.world / (_PCIE_GBPS * 1e9)
    return seconds, flops


def eval_seconds(spec: RunSpec, s: _Setup, r: _Run, rows: int | None, tokens_per_row: float,
                 steps: int | None) -> float:
    """Seconds of the run's validation passes: forward only, split across the ranks, over
    ``data.eval_samples`` validation rows (of the ~``validation_fraction`` share of the data),
    every ``train.eval_every`` steps (unset: ~EVALS_PER_RUN times) and once at the end."""
    from workbench.spec import EVALS_PER_RUN

    vf = spec.data.validation_fraction
    if not steps or rows is None or vf <= 0:
        return 0.0
    val = max(1, round(rows * vf / (1 - vf)))
    if spec.data.eval_samples:
        val = min(val, spec.data.eval_samples)
    every = spec.train.eval_every
    if every is None:  # a ratio of the total steps, rounded up by the Trainer
        every = max(1, math.ceil(steps / EVALS_PER_RUN))
    evals = (steps // every if every else 0) + (0 if every and steps % every == 0 else 1)
    flops = evals * val * tokens_per_row * _forward_flops_per_token(s.shape, s.seq_len)
    return flops / (r.gpu.bf16_tflops * 1e12 * r.n_devices * r.gpu.utilisation)
