"""The pre-launch planner: will this run fit, how is it parallelised, how long, what will it cost.

``plan(spec)`` counts the model's parameters from its config (instantiated on the meta device, so
nothing is downloaded), estimates the peak memory of every GPU (or CPU process) for every method x
strategy x offload combination, picks the cheapest strategy that fits with a safety margin, and
prices the run from the GPU table (:mod:`workbench.gpus`). Launch refuses a plan that does not fit
(:func:`check_fits`), and ``parallel.strategy: auto`` asks :func:`choose_strategy`. Every formula
is written out, with its sources and measured tolerances, in ``docs/planning.md``.

    >>> p = plan(RunSpec(train={"max_steps": 10}))  # doctest: +SKIP
    >>> p.fits, p.strategy.label
    (True, 'lora + ddp')
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from workbench.errors import ModelNotFoundError, WorkbenchError
from workbench.gpus import GpuType, get_gpu, gpu_table
from workbench.spec import ParallelSpec, RunSpec

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GiB = 2**30
Method = Literal["lora", "qlora", "full"]
Parallel = Literal["ddp", "zero1", "zero2", "zero3"]


class PlanError(WorkbenchError, RuntimeError):
    """A run cannot fit (or cannot be planned). The message says why and what to change."""


# -- model shape -------------------------------------------------------------------------------

# Offline defaults only: config fields (not parameter counts) of well-known models, copied from
# each model's config.json on the Hugging Face hub. Used when the hub is unreachable; the counts
# are still computed by instantiating these configs on the meta device.
OFFLINE_CONFIGS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "meta-llama/Llama-2-7b-hf": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, tie_word_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True),
    # https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json
    "Qwen/Qwen2.5-1.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=131072, tie_word_embeddings=True),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "Qwen/Qwen2.5-7B": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistralai/Mistral-7B-v0.1": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, tie_word_embeddings=False),
}
# Same architecture under other names (instruct variants share the base's shape).
_OFFLINE_ALIASES = {
    "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-2-7b-chat-hf": "meta-llama/Llama-2-7b-hf",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistralai/Mistral-7B-v0.1",
}


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, counted from its meta-device instance."""

    model_id: str
    params: int  # unique parameters (tied embeddings counted once)
    linear_weights: int  # every nn.Linear weight except lm_head: what 4/8-bit quantisation packs
    lm_head_weights: int  # matmul FLOPs of the output layer (also when tied to the embeddings)
    largest_layer_params: int  # biggest single module (ZeRO-3 gathers one at a time)
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) LoRA could target
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    source: str  # "config" or "offline table"

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        """Adapter parameters: r x (in + out) per targeted linear, matched like peft does."""
        total = 0
        for name, fan_in, fan_out in self.linears:
            if targets == "all-linear" or any(
                name == t or name.endswith("." + t) for t in targets
            ):
                total += r * (fan_in + fan_out)
        return total


def _hub_reachable(timeout: float = 1.5) -> bool:
    # A failed AutoConfig download retries for ~30 s; a live plan in a form cannot wait that long.
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = host.partition(":")
    try:
        with socket.create_connection((host, int(port or 443)), timeout=timeout):
            return True
    except OSError:
        return False


def _config_for(model_id: str, revision: str | None, trust_remote_code: bool) -> tuple[Any, str]:
    from transformers import AutoConfig

    from workbench.models import load_config, resolve_model

    offline_key = _OFFLINE_ALIASES.get(model_id, model_id)
    source = resolve_model(model_id)
    is_hub = source == model_id and not Path(os.path.expanduser(model_id)).exists()
    if is_hub and offline_key in OFFLINE_CONFIGS and not _hub_reachable():
        fields = dict(OFFLINE_CONFIGS[offline_key])
        return AutoConfig.for_model(fields.pop("model_type"), **fields), "offline table"
    try:
        return load_config(model_id, revision, trust_remote_code), "config"
    except ModelNotFoundError:
        if offline_key not in OFFLINE_CONFIGS:
            raise
        fields = dict(OFFLINE_CONFIGS[offline_key])
        return AutoConfig.for_model(fields.pop("model_type"), **fields), "offline table"


@functools.lru_cache(maxsize=32)
def model_shape(model_id: str, revision: str | None = None,
                trust_remote_code: bool = False) -> ModelShape:
    """Count parameters and LoRA-able layers of ``model_id`` without downloading weights."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    cfg, source = _config_for(model_id, revision, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    out_emb = model.get_output_embeddings()
    linears: list[tuple[str, int, int]] = []
    linear_weights = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not out_emb:
            # peft's "all-linear" also skips the output layer.
            linears.append((name, module.in_features, module.out_features))
            linear_weights += module.weight.numel()
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(getattr(text_cfg, "num_attention_heads", 1))
    hidden = int(getattr(text_cfg, "hidden_size", 0))
    return ModelShape(
        model_id=model_id,
        params=sum(p.numel() for p in model.parameters()),
        linear_weights=linear_weights,
        lm_head_weights=out_emb.weight.numel() if out_emb is not None else 0,
        largest_layer_params=largest,
        linears=tuple(linears),
        hidden=hidden,
        layers=int(getattr(text_cfg, "num_hidden_layers", 1)),
        heads=heads,
        kv_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        intermediate=int(getattr(text_cfg, "intermediate_size", 4 * hidden)),
        vocab=int(getattr(text_cfg, "vocab_size", 0)),
        source=source,
    )


# -- memory ------------------------------------------------------------------------------------

# bitsandbytes NF4 with double quantisation (QLoRA, Dettmers et al. 2023, sec. 3): 4 bits per
# weight + 8-bit absmax per 64 weights + fp32 second-level constant per 256 blocks
# = 4 + 8/64 + 32/(64*256) = 4.127 bits. LLM.int8: 8 bits + one fp32 scale per row (negligible).
_QUANT_BYTES = {"4bit": 4.127 / 8, "8bit": 1.0}
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers that torch's allocator does not count,
# plus allocator fragmentation; measured ~0.5-0.9 GiB context on A100/H100 with torch 2.x.
_GPU_FIXED_OVERHEAD_GIB = 0.9
_FRAGMENTATION = 0.05
# A CPU training process: python + torch + transformers + peft imported, before the model.
_CPU_FIXED_OVERHEAD_GIB = 0.6
# Bytes per (token x vocab entry) at the peak of the loss: fp32 log-softmax saved for backward
# plus its incoming gradient and the gradient it produces (transformers' ForCausalLMLoss upcasts
# the logits to fp32); the low-precision logits are freed before backward.
_LOGIT_BYTES = 12
# DeepSpeed bucket sizes the trainer's config uses (elements): reduce + all-gather for ZeRO-1/2.
_DS_BUCKET = 2e8


@dataclass(frozen=True)
class Strategy:
    """How a run is trained: method and how the data-parallel replicas share model states."""

    method: Method
    parallel: Parallel
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def label(self) -> str:
        extra = []
        if self.offload_optimizer:
            extra.append("optimizer")
        if self.offload_params:
            extra.append("params")
        off = f" + offload {' & '.join(extra)}" if extra else ""
        return f"{self.method} + {self.parallel}{off}"

    def parallel_spec(self) -> ParallelSpec:
        return ParallelSpec(strategy=self.parallel, offload_optimizer=self.offload_optimizer,
                            offload_params=self.offload_params)


@dataclass
class MemoryBreakdown:
    """Peak memory of one GPU (or CPU process), GiB per component."""

    weights: float  # model weights as held for compute (frozen base, or the working copy)
    trainable: float  # separate copy of trainable params: LoRA adapters, fp32 master weights
    gradients: float
    optimizer: float  # AdamW moments
    activations: float  # with or without gradient checkpointing, as the spec says
    overhead: float  # CUDA context, workspaces, DeepSpeed buckets, fragmentation
    activations_with_checkpointing: float = 0.0
    activations_without_checkpointing: float = 0.0
    host_offloaded: float = 0.0  # what offload moves to host RAM, per process

    COMPONENTS = ("weights", "trainable", "gradients", "optimizer", "activations", "overhead")

    @property
    def total(self) -> float:
        return sum(getattr(self, c) for c in self.COMPONENTS)

    @property
    def model_states(self) -> float:
        """Weights + trainable + gradients + optimizer: what DeepSpeed's estimators count."""
        return self.weights + self.trainable + self.gradients + self.optimizer

    def to_dict(self) -> dict[str, float]:
        d = {k: round(v, 4) for k, v in asdict(self).items()}
        d["total"] = round(self.total, 4)
        return d


@dataclass(frozen=True)
class _Setup:
    """Everything besides the strategy that memory and time depend on."""

    shape: ModelShape
    compute_bytes: int  # 2 for bf16/fp16, 4 for fp32
    micro_batch: int
    seq_len: int
    world: int
    nodes: int
    lora_r: int
    targets: list[str] | str
    checkpointing: bool
    on_gpu: bool


def _activation_bytes(s: _Setup, checkpointing: bool, logit_bytes: float = 0.0) -> float:
    """Peak activation bytes of one micro-batch (flash/SDPA attention, no dropout).

    Per layer and token, autograd keeps (in compute dtype b unless noted): the two RMSNorm inputs
    in fp32 (transformers upcasts them), the attention block's norm output, q, k, v (k/v repeated
    to full width for GQA), the attention output and the o_proj input (~6h), and the MLP's norm
    output, gate, SiLU(gate), up and their product (h + 4f). This adapts Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", sec. 4.1, 34·s·b·h bytes per
    layer for GPT) to Llama's SwiGLU MLP and fp32 norms, without the attention-score term that
    flash attention removes.

    The loss holds _LOGIT_BYTES per token x vocab entry at the start of backward, when (without
    checkpointing) every layer's activations are still alive. With gradient checkpointing only
    each layer's input (b·h) is kept; the loss buffers are freed before the first layer is
    recomputed, so the peak is the larger of the two moments, not their sum. Backward through a
    layer briefly adds gradient tensors (~3f + 2h per token).
    """
    tokens = s.micro_batch * s.seq_len
    b = s.compute_bytes
    h, f = s.shape.hidden, s.shape.intermediate
    per_layer = tokens * (b * (7 * h + 4 * f) + 2 * 4 * h)
    backward_transient = tokens * b * (3 * f + 2 * h)
    logits = tokens * s.shape.vocab * logit_bytes
    embeddings_and_final_norm = tokens * h * (b + 4)
    if checkpointing:
        kept = s.shape.layers * tokens * h * b
        return kept + embeddings_and_final_norm + max(logits, per_layer + backward_transient)
    kept = s.shape.layers * per_layer
    return kept + embeddings_and_final_norm + max(logits, backward_transient)


def estimate_memory(s: _Setup, st: Strategy, logit_bytes: float = _LOGIT_BYTES) -> MemoryBreakdown:
    """Per-GPU peak memory of one strategy. Model-state formulas follow DeepSpeed's estimators
    (``estimate_zero2_model_states_mem_needs``/``estimate_zero3_...``) for mixed precision:
    2 B bf16 weights, 4 B fp32 master, 2 B bf16 + 4 B fp32 gradients, 8 B Adam moments per
    trainable parameter; ZeRO-1 shards the optimizer (and master), ZeRO-2 also the gradients,
    ZeRO-3 also the weights (Rajbhandari et al. 2020, "ZeRO", sec. 5).

    ``logit_bytes`` is what the loss holds per token x vocab entry: 12 for transformers' fp32
    cross-entropy; a chunked loss (torchtune's CEWithChunkedOutputLoss) holds far less."""
    sh = s.shape
    n = s.world
    b = s.compute_bytes
    p = sh.params
    full = st.method == "full"
    trainable_params = p if full else sh.lora_params(s.lora_r, s.targets)
    zero = st.parallel != "ddp"
    z3 = st.parallel == "zero3"

    # Weights held for compute (bytes, as floats: quantised sizes are fractional).
    frozen_bytes: float
    weights: float
    if st.method == "qlora":
        quant = _QUANT_BYTES["4bit"]
        frozen_bytes = sh.linear_weights * quant + (p - sh.linear_weights) * b
    else:
        frozen_bytes = p * b
    if full and not zero:
        # torch AMP over fp32 weights: the fp32 parameters are the weights; autocast keeps a bf16
        # copy of each weight until backward has used it.
        weights = p * 4 + (p * b if b < 4 else 0)
    elif z3:
        gathered = 2 * b * sh.largest_layer_params  # one layer's weights + their gradients
        weights = (0 if st.offload_params else frozen_bytes / n) + gathered
    else:
        weights = frozen_bytes

    # Trainable copy, gradients, optimizer.
    trainable: float
    grads: float
    optim: float
    host = 0.0
    t = trainable_params
    if not zero:
        if full:
            trainable = 0.0  # the fp32 weights above are the trainable parameters
            grads = t * 4
        else:
            # peft keeps adapters in fp32 (autocast_adapter_dtype), so their grads are fp32 too.
            trainable = t * 4
            grads = t * 4
        optim = t * 8
    else:
        shard = t / n
        # DeepSpeed casts the module (adapters included) to bf16 and keeps an fp32 master copy.
        adapter_working = 0.0 if full else (t * b / n if z3 else t * b)
        master = shard * 4
        optim = shard * 8
        if st.parallel == "zero1":
            grads = t * b + shard * 4
        elif st.parallel == "zero2":
            grads = shard * (b + 4)
        else:
            grads = shard * 4  # bf16 grads are reduce-scattered at once; see `gathered`
        trainable = adapter_working + master
        if st.offload_optimizer:
            host += master + optim + shard * 4
            trainable -= master
            # DeepSpeed reduces gradients straight into pinned host buffers.
            grads = t * b if st.parallel == "zero1" else 0.0
            optim = 0.0
        if z3 and st.offload_params:
            host += frozen_bytes / n + adapter_working
            trainable -= adapter_working

    act_gc = _activation_bytes(s, True, logit_bytes)
    act_no = _activation_bytes(s, False, logit_bytes)
    act = act_gc if s.checkpointing else act_no

    if zero and not z3:
        buffers = 2 * min(t, _DS_BUCKET) * b
    elif z3:
        buffers = 0.9 * sh.hidden**2 * b  # stage3_prefetch_bucket_size = 0.9 h^2 ("auto")
    else:
        buffers = 0.0
    if not zero and n > 1:
        # DDP's reducer copies every gradient into flat all-reduce buckets (the Trainer does not
        # set gradient_as_bucket_view), so gradient memory is held twice.
        buffers += grads
    dynamic = weights + trainable + grads + optim + act + buffers
    fixed = _GPU_FIXED_OVERHEAD_GIB if s.on_gpu else _CPU_FIXED_OVERHEAD_GIB
    overhead = buffers + fixed * GiB + (_FRAGMENTATION * dynamic if s.on_gpu else 0.0)
    return MemoryBreakdown(
        weights=weights / GiB, trainable=trainable / GiB, gradients=grads / GiB,
        optimizer=optim / GiB, activations=act / GiB, overhead=overhead / GiB,
        activations_with_checkpointing=act_gc / GiB,
        activations_without_checkpointing=act_no / GiB,
        host_offloaded=host / GiB,
    )


def safety_margin_gib(capacity_gib: float) -> float:
    """Headroom kept free: 8% of the card, at least 2 GiB (6.4 GiB on an 80 GB card)."""
    return max(2.0, 0.08 * capacity_gib)


def all_strategies(world: int) -> list[Strategy]:
    """Every valid combination, cheapest first within each method (ZeRO shards need world > 1,
    offloading is what you pay for when nothing else fits)."""
    out = []
    for method in ("full", "lora", "qlora"):
        out.append(Strategy(method, "ddp"))
        if world > 1:
            out += [Strategy(method, "zero1"), Strategy(method, "zero2"),
                    Strategy(method, "zero3")]
        out += [Strategy(method, "zero2", offload_optimizer=True),
                Strategy(method, "zero3", offload_optimizer=True),
                Strategy(method, "zero3", offload_optimizer=True, offload_params=True)]
    return out


# -- data and time -----------------------------------------------------------------------------

_CHARS_PER_TOKEN = 3.6  # English BPE average (OpenAI's rule of thumb: ~4 chars per token)
_TEMPLATE_TOKENS = 12  # chat template / role markers around each example


def _text_chars(row: dict[str, Any]) -> int:
    total = 0
    for value in row.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):  # messages / conversations
            total += sum(len(str(m.get("content", m.get("value", ""))))
                         if isinstance(m, dict) else len(str(m)) for m in value)
    return total


def _source_rows(path: str) -> tuple[int | None, list[dict[str, Any]]]:
    """(row count, a sample of rows) of one data source; count None when not cheaply known."""
    if path == "builtin:teaching":
        from workbench.assets.teaching import teaching_rows

        rows = list(teaching_rows("train"))
        return len(rows), rows[:512]
    p = Path(os.path.expanduser(path))
    if p.is_file() and p.suffix == ".jsonl":
        sample: list[dict[str, Any]] = []
        count = 0
        with p.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                count += 1
                if len(sample) < 512:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        sample.append(obj)
        return count, sample
    if p.is_file() and p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(p).metadata.num_rows, []
    return None, []


@dataclass
class DataEstimate:
    rows: int | None  # training rows after the validation split; None when unknown
    tokens_per_example: float  # average tokens one example costs (padding included)
    note: str


def estimate_data(spec: RunSpec) -> DataEstimate:
    total: int | None = 0
    sample: list[dict[str, Any]] = []
    unknown = []
    for src in spec.data.sources:
        count, rows = _source_rows(src.path)
        if count is None:
            unknown.append(src.path)
        else:
            if src.max_rows is not None:
                count = min(count, src.max_rows)
            total = (total or 0) + count
        sample += rows
    if unknown:
        total = None
    elif total is not None:
        total = max(1, int(total * (1 - spec.data.validation_fraction)))
    L = spec.data.max_length
    lengths = [min(L, _text_chars(r) / _CHARS_PER_TOKEN + _TEMPLATE_TOKENS) for r in sample]
    per_example: float
    if spec.data.packing:
        per_example = L  # packed blocks are full by construction
        note = "packed: every sequence is max_length tokens"
    elif lengths:
        # Each batch is padded to its longest example: average the per-batch maximum.
        bs = spec.train.batch_size
        batches = [lengths[i:i + bs] for i in range(0, len(lengths), bs)]
        per_example = sum(max(b_) for b_ in batches) / len(batches)
        note = (f"not packed: ~{per_example:.0f} tokens per example after padding, estimated "
                f"from {len(lengths)} sampled rows at {_CHARS_PER_TOKEN} characters per token")
    else:
        per_example = L
        note = "not packed and the data could not be sampled: assumed max_length per example"
    if unknown:
        note += f"; row count unknown for {', '.join(unknown)} (set train.max_steps)"
    if spec.data.packing and total is not None and lengths:
        # Packing turns rows into max_length blocks: estimate blocks from sampled text length.
        avg = sum(lengths) / len(lengths)
        total = max(1, int(total * avg / L))
        note += f"; ~{total:,} packed blocks"
    return DataEstimate(total, per_example, note)


def _forward_flops_per_token(sh: ModelShape, seq_len: int) -> float:
    # 2 FLOPs per multiply-add of every linear layer (lm_head included), plus attention scores and
    # their weighting, 2·n_layer·n_ctx·d (Kaplan et al. 2020, table 1; causal masking halves the
    # 4·n_ctx·d of QK^T + AV).
    return 2 * (sh.linear_weights + sh.lm_head_weights) + 2 * sh.layers * seq_len * sh.hidden


# QLoRA trains ~1.66x slower than LoRA (dequantising every weight in forward and backward):
# Google Cloud's Vertex AI tuning recommendations ("LoRA is about 66% faster than QLoRA").
_QLORA_SLOWDOWN = 1.66
_INTER_NODE_GBPS = 12.5  # 100 Gb/s InfiniBand/RoCE, the common cluster fabric
_PCIE_GBPS = 16.0  # effective host<->device copy bandwidth (PCIe 4.0 x16 pinned)
_CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPUAdam on a many-core host (ZeRO-Offload paper)


@dataclass(frozen=True)
class _Run:
    tokens_per_step: int  # processed tokens (padding included) per optimizer step, all ranks
    steps: int | None
    gpu: GpuType
    n_devices: int  # GPUs in total, or CPU cores in total for CPU runs
    on_gpu: bool


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
    if st.method == "qlora":
        seconds *= _QLORA_SLOWDOWN
    # Gradient all-reduce (ring: 2(n-1)/n of the gradient bytes), half hidden behind backward.
    t = sh.params if st.method == "full" else lora
    if s.world > 1:
        bw = (_INTER_NODE_GBPS if s.nodes > 1 else r.gpu.interconnect_gbps) * 1e9
        comm = 2 * (s.world - 1) / s.world * t * s.compute_bytes / bw
        if st.parallel == "zero3":
            comm *= 1.5  # + parameter all-gathers in forward and backward (ZeRO paper, sec. 7)
        seconds += 0.5 * comm
    if st.offload_optimizer:
        seconds += t / s.world / _CPU_ADAM_PARAMS_PER_S + 2 * 4 * t / s.world / (_PCIE_GBPS * 1e9)
    if st.offload_params:
        seconds += 2 * s.compute_bytes * sh.params / s.world / (_PCIE_GBPS * 1e9)
    return seconds, flops


# -- the plan ----------------------------------------------------------------------------------


@dataclass
class Candidate:
    strategy: Strategy
    memory: MemoryBreakdown
    fits: bool
    hours: float | None
    cost: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": asdict(self.strategy), "label": self.strategy.label,
                "memory_gib": self.memory.to_dict(), "fits": self.fits,
                "hours": self.hours, "cost": self.cost}


@dataclass
class Suggestion:
    """A concrete change, as text and as dotted spec fields (``spec.updated(**changes)``)."""

    text: str
    changes: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text


@dataclass
class Plan:
    """What the planner decided and why. ``summary()`` for a terminal, ``plot()`` for a chart,
    ``to_dict()`` for RUN_DIR/plan.json."""

    model_id: str
    model_source: str  # "config" or "offline table"
    params: int
    trainable_params: int
    gpu_type: str
    device: Literal["gpu", "cpu"]
    devices_per_node: int  # GPUs per node (CPU runs: processes per node)
    nodes: int
    world_size: int
    memory: MemoryBreakdown
    capacity_gib: float
    safety_margin_gib: float
    fits: bool
    strategy: Strategy
    reasons: list[str]
    candidates: list[Candidate]
    tokens_per_step: int
    steps: int | None
    total_tokens: int | None
    flops: float | None
    hours: float | None
    cost: float | None
    currency: str
    price_per_hour: float | None  # per GPU-hour (per core-hour on CPU)
    budget_limit: float | None
    budget_verdict: Literal["within budget", "over budget", "no limit", "unknown"]
    suggestions: list[Suggestion]
    data_note: str
    assumptions: list[str]

    @property
    def headroom_gib(self) -> float:
        return self.capacity_gib - self.memory.total

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "model_id", "model_source", "params", "trainable_params", "gpu_type", "device",
            "devices_per_node", "nodes", "world_size", "capacity_gib", "safety_margin_gib",
            "fits", "reasons", "tokens_per_step", "steps", "total_tokens", "flops", "hours",
            "cost", "currency", "price_per_hour", "budget_limit", "budget_verdict", "data_note",
            "assumptions")}
        d["headroom_gib"] = round(self.headroom_gib, 4)
        d["memory_gib"] = self.memory.to_dict()
        d["strategy"] = {**asdict(self.strategy), "label": self.strategy.label}
        d["candidates"] = [c.to_dict() for c in self.candidates]
        d["suggestions"] = [{"text": s.text, "changes": s.changes} for s in self.suggestions]
        return d

    def summary(self) -> str:
        m = self.memory
        unit = "GPU" if self.device == "gpu" else "process (host RAM)"
        lines = [
            f"Plan for {self.model_id}: {_fmt_count(self.params)} parameters "
            f"({_fmt_count(self.trainable_params)} trainable; counts from {self.model_source})",
            f"Hardware: {self.nodes} node(s) x {self.devices_per_node} "
            f"{self.gpu_type if self.device == 'gpu' else 'CPU process(es)'}, "
            f"world size {self.world_size}",
            f"Strategy: {self.strategy.label}",
            f"Memory per {unit} (GiB):",
        ]
        for c in MemoryBreakdown.COMPONENTS:
            lines.append(f"  {c:<12}{getattr(m, c):>9.2f}")
        lines.append(f"  {'total':<12}{m.total:>9.2f}  of {self.capacity_gib:.1f} "
                     f"(keeping {self.safety_margin_gib:.1f} free) -> "
                     f"{'FITS' if self.fits else 'DOES NOT FIT'}")
        lines.append(f"  activations with / without gradient checkpointing: "
                     f"{m.activations_with_checkpointing:.2f} / "
                     f"{m.activations_without_checkpointing:.2f}")
        if m.host_offloaded:
            lines.append(f"  offloaded to host RAM per process: {m.host_offloaded:.2f}")
        lines.append(f"Tokens: {self.tokens_per_step:,} per step"
                     + (f", {self.total_tokens:,} over {self.steps:,} steps"
                        if self.steps else "; number of steps unknown"))
        lines.append(f"Data: {self.data_note}")
        if self.hours is not None:
            lines.append(f"Time: {_fmt_hours(self.hours)} ({self.flops:.3g} FLOPs)")
        if self.cost is not None:
            lines.append(f"Cost: {self.cost:,.2f} {self.currency}"
                         f" at {self.price_per_hour:g} {self.currency} per "
                         f"{'GPU' if self.device == 'gpu' else 'core'}-hour")
        lines.append(f"Budget: {self.budget_verdict}"
                     + (f" (limit {self.budget_limit:,.2f} {self.currency})"
                        if self.budget_limit else ""))
        lines += [f"  - {r}" for r in self.reasons]
        if self.suggestions:
            lines.append("Suggestions:")
            lines += [f"  * {s.text}" for s in self.suggestions]
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Figure:
        """A stacked bar of the per-GPU breakdown against the card's memory and safety margin."""
        if ax is None:
            # A bare Figure, not pyplot: no global figure registry to leak in a long-lived kernel.
            from matplotlib.figure import Figure as _Figure

            fig = _Figure(figsize=(7, 2.4))
            ax = fig.add_subplot(1, 1, 1)
        else:
            fig = ax.figure
        left = 0.0
        colors = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#8c8c8c")
        for comp, color in zip(MemoryBreakdown.COMPONENTS, colors, strict=True):
            value = getattr(self.memory, comp)
            ax.barh([0], [value], left=left, color=color, label=f"{comp} {value:.1f}")
            left += value
        cap = self.capacity_gib
        ax.axvline(cap, color="black", linewidth=2, label=f"{self.gpu_type} {cap:.0f} GiB")
        ax.axvline(cap - self.safety_margin_gib, color="black", linestyle="--", linewidth=1,
                   label="safety margin")
        ax.set_xlim(0, max(cap, left) * 1.05)
        ax.set_yticks([])
        ax.set_xlabel("GiB per GPU" if self.device == "gpu" else "GiB per process")
        title = f"{self.strategy.label}: {'fits' if self.fits else 'does NOT fit'}"
        if self.hours is not None:
            title += f" | {_fmt_hours(self.hours)}"
        if self.cost is not None:
            title += f" | {self.cost:,.2f} {self.currency}"
        ax.set_title(title)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize="small",
                  frameon=False)
        fig.subplots_adjust(bottom=0.45)
        return fig

    def _repr_html_(self) -> str:
        import html

        color = "green" if self.fits else "crimson"
        return (f"<div><b style='color:{color}'>{'fits' if self.fits else 'does not fit'}</b>"
                f"<pre>{html.escape(self.summary())}</pre></div>")


def _fmt_count(n: float) -> str:
    """6.74B, 4.19M, 609K, 512: a parameter count the way model cards write it."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _fmt_hours(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h"


def _resolve_gpu(spec: RunSpec, gpu_type: str | None) -> tuple[GpuType, bool]:
    table = gpu_table()
    if spec.resources.gpus_per_node == 0:
        return table["CPU"], False
    name = gpu_type or spec.resources.gpu_type
    if name is None:
        from workbench.gpus import detect_gpu_type

        name = detect_gpu_type()
    if name is None:
        raise PlanError(
            "no GPU type to plan against: set resources.gpu_type (e.g. 'A100-80G'; known types: "
            f"{', '.join(n for n in table if n != 'CPU')}) or run where a GPU is visible"
        )
    return get_gpu(name, table), True


def _setup(spec: RunSpec, shape: ModelShape, on_gpu: bool, seq_len: int) -> _Setup:
    dtype = spec.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    return _Setup(
        shape=shape,
        compute_bytes=4 if dtype == "float32" else 2,
        micro_batch=spec.train.batch_size,
        seq_len=seq_len,
        world=spec.resources.world_size,
        nodes=spec.resources.nodes,
        lora_r=spec.method.lora_r,
        targets=spec.method.target_modules,
        checkpointing=spec.train.gradient_checkpointing,
        on_gpu=on_gpu,
    )


def _evaluate(spec: RunSpec, gpu: GpuType, on_gpu: bool, shape: ModelShape,
              data: DataEstimate) -> Plan:
    res = spec.resources
    s = _setup(spec, shape, on_gpu, spec.data.max_length)
    if on_gpu:
        capacity = gpu.memory_gib
        n_devices = res.gpus_per_node * res.nodes
        price = spec.budget.price_per_gpu_hour
    else:
        capacity = gpu.memory_gib / res.procs_per_node  # every process shares the host's RAM
        n_devices = (os.cpu_count() or 1) * res.nodes
        price = spec.budget.price_per_cpu_core_hour
    if price is None:
        price = gpu.price_per_hour
    currency = spec.budget.currency
    assumptions = []
    if on_gpu and spec.budget.price_per_gpu_hour is None and gpu.price_per_hour is not None \
            and gpu.currency != currency:
        assumptions.append(f"prices in the GPU table are in {gpu.currency}, the budget in "
                           f"{currency}: cost shown in {gpu.currency}")
        currency = gpu.currency
    margin = safety_margin_gib(capacity)
    global_batch = spec.train.batch_size * spec.train.grad_accum * res.world_size
    tokens_per_step = int(round(global_batch * data.tokens_per_example))
    if spec.train.max_steps is not None:
        steps: int | None = spec.train.max_steps
    elif data.rows is not None:
        per_epoch = max(1, math.ceil(data.rows / (spec.train.batch_size * res.world_size))
                        // spec.train.grad_accum)
        steps = max(1, math.ceil(spec.train.epochs * per_epoch))
    else:
        steps = None
    run = _Run(tokens_per_step, steps, gpu, n_devices, on_gpu)
    # Activations are planned at max_length (a padded batch can hit it); time at the estimate.
    s_time = _setup(spec, shape, on_gpu, int(max(1, data.tokens_per_example)))

    candidates = []
    for st in all_strategies(res.world_size):
        mem = estimate_memory(s, st)
        secs, _ = step_seconds(s_time, st, run)
        hours = secs * steps / 3600 if steps else None
        cost = hours * n_devices * price if hours is not None and price is not None else None
        candidates.append(Candidate(st, mem, mem.total <= capacity - margin, hours, cost))

    wanted = spec.parallel
    reasons: list[str] = []
    mine = [c for c in candidates if c.strategy.method == spec.method.kind]
    if wanted.strategy == "auto":
        fitting = [c for c in mine if c.fits]
        # Cheapest = fastest (cost is time x cards); among equals the simpler one (list order).
        chosen = min(fitting, key=lambda c: c.hours or 0.0) if fitting else min(
            mine, key=lambda c: c.memory.total)
        reasons.append("parallel: auto -> " + (
            f"{chosen.strategy.label} is the fastest strategy that fits"
            if fitting else f"nothing fits; {chosen.strategy.label} needs the least memory"))
    else:
        target = Strategy(spec.method.kind, wanted.strategy, wanted.offload_optimizer,
                          wanted.offload_params)
        chosen = next((c for c in mine if c.strategy == target), None)  # type: ignore[assignment]
        if chosen is None:
            # e.g. ZeRO-1/2/3 without offload on one process, or ddp + offload: still evaluate.
            mem = estimate_memory(s, target)
            secs, _ = step_seconds(s_time, target, run)
            hours = secs * steps / 3600 if steps else None
            cost = hours * n_devices * price if hours is not None and price else None
            chosen = Candidate(target, mem, mem.total <= capacity - margin, hours, cost)
            if target.parallel == "ddp" and (target.offload_optimizer or target.offload_params):
                chosen.fits = False
                reasons.append("offloading needs DeepSpeed: use parallel.strategy zero2 or zero3")
            if target.offload_params and target.parallel != "zero3":
                chosen.fits = False
                reasons.append("parallel.offload_params needs parallel.strategy: zero3")
        reasons.append(f"parallel.strategy: {wanted.strategy} as the spec says")

    mem = chosen.memory
    unit = "GPU" if on_gpu else "process"
    if chosen.fits:
        reasons.append(f"peak {mem.total:.1f} GiB per {unit} leaves "
                       f"{capacity - mem.total:.1f} GiB of {capacity:.1f} free "
                       f"(margin {margin:.1f})")
    else:
        biggest = max(MemoryBreakdown.COMPONENTS, key=lambda c: getattr(mem, c))
        reasons.append(f"peak {mem.total:.1f} GiB per {unit} exceeds {capacity - margin:.1f} GiB "
                       f"usable of {capacity:.1f} ({gpu.name}, keeping {margin:.1f} free); "
                       f"largest part: {biggest} {getattr(mem, biggest):.1f} GiB")
    if mem.host_offloaded:
        # Not part of `fits`: the target's host RAM is not known here (a remote node's may differ).
        reasons.append(f"offloading needs ~{mem.host_offloaded * res.procs_per_node:.0f} GiB of "
                       f"host RAM per node ({mem.host_offloaded:.1f} GiB per process)")
    if steps is None:
        reasons.append("time and cost unknown: the number of training rows is unknown; "
                       "set train.max_steps")
    if chosen.hours is not None and price is None:
        reasons.append(f"no price for {gpu.name}: set budget.price_per_gpu_hour or edit gpus.yaml")

    limit = spec.budget.limit
    verdict: Literal["within budget", "over budget", "no limit", "unknown"]
    if limit is None:
        verdict = "no limit"
    elif chosen.cost is None:
        verdict = "unknown"
    else:
        verdict = "within budget" if chosen.cost <= limit else "over budget"

    _, flops_step = step_seconds(s_time, chosen.strategy, run)
    trainable = shape.params if spec.method.kind == "full" else shape.lora_params(
        spec.method.lora_r, spec.method.target_modules)
    if not on_gpu:
        assumptions.append("CPU run: memory is host RAM shared by the processes; time at "
                           f"{gpu.utilisation:.0%} of {gpu.bf16_tflops} TFLOP/s per core")
    else:
        assumptions.append(f"{gpu.name}: {gpu.bf16_tflops:g} TFLOP/s bf16 peak at "
                           f"{gpu.utilisation:.0%} utilisation")
    return Plan(
        model_id=spec.model.id, model_source=shape.source, params=shape.params,
        trainable_params=trainable, gpu_type=gpu.name, device="gpu" if on_gpu else "cpu",
        devices_per_node=res.gpus_per_node if on_gpu else res.procs_per_node, nodes=res.nodes,
        world_size=res.world_size, memory=mem, capacity_gib=capacity, safety_margin_gib=margin,
        fits=chosen.fits, strategy=chosen.strategy, reasons=reasons, candidates=candidates,
        tokens_per_step=tokens_per_step, steps=steps,
        total_tokens=tokens_per_step * steps if steps else None,
        flops=flops_step * steps if steps else None, hours=chosen.hours, cost=chosen.cost,
        currency=currency, price_per_hour=price, budget_limit=limit, budget_verdict=verdict,
        suggestions=[], data_note=data.note, assumptions=assumptions,
    )


def _suggest(spec: RunSpec, p: Plan, gpu: GpuType, on_gpu: bool, shape: ModelShape,
             data: DataEstimate) -> list[Suggestion]:
    """Concrete changes, each checked by re-planning the changed spec."""
    out: list[Suggestion] = []

    def check(changes: dict[str, Any], gpu_over: GpuType | None = None) -> Plan | None:
        try:
            variant = spec.updated(**changes)
        except WorkbenchError:
            return None
        return _evaluate(variant, gpu_over or gpu, on_gpu, shape, data)

    if not p.fits:
        if spec.parallel.strategy != "auto":
            q = check({"parallel.strategy": "auto", "parallel.offload_optimizer": False,
                       "parallel.offload_params": False})
            if q and q.fits:
                ps = q.strategy.parallel_spec()
                out.append(Suggestion(
                    f"use {q.strategy.label} (parallel.strategy: {ps.strategy}"
                    + (", offload_optimizer: true" if ps.offload_optimizer else "")
                    + (", offload_params: true" if ps.offload_params else "") + ")",
                    {"parallel.strategy": ps.strategy,
                     "parallel.offload_optimizer": ps.offload_optimizer,
                     "parallel.offload_params": ps.offload_params}))
        if not spec.train.gradient_checkpointing:
            q = check({"train.gradient_checkpointing": True})
            if q and q.fits:
                out.append(Suggestion("turn on gradient checkpointing "
                                      "(train.gradient_checkpointing: true; ~30% slower)",
                                      {"train.gradient_checkpointing": True}))
        bs = spec.train.batch_size
        if bs > 1:
            for smaller in sorted({bs // 2, bs // 4, 1} - {0}, reverse=True):
                accum = spec.train.grad_accum * bs // smaller
                q = check({"train.batch_size": smaller, "train.grad_accum": accum})
                if q and q.fits:
                    out.append(Suggestion(
                        f"train.batch_size {smaller} with train.grad_accum {accum} "
                        "(same global batch, less activation memory)",
                        {"train.batch_size": smaller, "train.grad_accum": accum}))
                    break
        for kind, label in (("lora", "use LoRA"), ("qlora", "use QLoRA")):
            if kind == spec.method.kind or (spec.method.kind == "qlora" and kind == "lora"):
                continue
            ch: dict[str, Any] = {"method.kind": kind, "parallel.strategy": "auto"}
            ch["model.quantization"] = "4bit" if kind == "qlora" else "none"
            q = check(ch)
            if q and q.fits:
                out.append(Suggestion(f"{label} (method.kind: {kind}): "
                                      f"{q.memory.total:.1f} GiB per GPU", ch))
                break
        if on_gpu:
            res = spec.resources
            for n in (2, 4, 8):
                if n <= res.gpus_per_node:
                    continue
                ch = {"resources.gpus_per_node": n, "parallel.strategy": "auto"}
                if res.processes_per_node is not None:
                    ch["resources.processes_per_node"] = n
                q = check(ch)
                if q and q.fits:
                    out.append(Suggestion(f"{n} GPUs (resources.gpus_per_node: {n}) with "
                                          f"{q.strategy.label}", ch))
                    break
            table = gpu_table()
            bigger = sorted((g for g in table.values() if g.name not in ("CPU", gpu.name)
                             and g.memory_gib > gpu.memory_gib),
                            key=lambda g: (g.price_per_hour is None, g.price_per_hour or 0,
                                           g.memory_gib))
            for g in bigger:
                q = check({"resources.gpu_type": g.name, "parallel.strategy": "auto"}, g)
                if q and q.fits:
                    out.append(Suggestion(f"a bigger card: resources.gpu_type {g.name} "
                                          f"({g.memory_gib:.0f} GiB) with {q.strategy.label}",
                                          {"resources.gpu_type": g.name,
                                           "parallel.strategy": "auto"}))
                    break
        if not out:
            out.append(Suggestion(
                "nothing tried fits: use a smaller model, a shorter data.max_length, or more "
                "GPUs/nodes"))
    if p.budget_verdict == "over budget" and p.cost and p.steps and p.budget_limit:
        per_step = p.cost / p.steps
        steps = int(p.budget_limit / per_step)
        if steps >= 1:
            out.append(Suggestion(f"train.max_steps {steps:,} stays within the budget of "
                                  f"{p.budget_limit:,.2f} {p.currency}",
                                  {"train.max_steps": steps}))
        if spec.method.kind == "full":
            q = check({"method.kind": "lora", "parallel.strategy": "auto"})
            if q and q.cost is not None and q.fits and q.cost <= p.budget_limit:
                out.append(Suggestion(f"use LoRA: {q.cost:,.2f} {q.currency}",
                                      {"method.kind": "lora", "parallel.strategy": "auto"}))
        if on_gpu:
            for g in gpu_table().values():
                if g.name in ("CPU", gpu.name) or g.price_per_hour is None:
                    continue
                q = check({"resources.gpu_type": g.name, "parallel.strategy": "auto"}, g)
                if q and q.fits and q.cost is not None and q.cost <= p.budget_limit:
                    out.append(Suggestion(f"resources.gpu_type {g.name}: {q.cost:,.2f} "
                                          f"{q.currency}", {"resources.gpu_type": g.name,
                                                            "parallel.strategy": "auto"}))
                    break
    if p.steps is None:
        out.append(Suggestion("set train.max_steps so time and cost can be estimated"))
    return out


def plan(spec: RunSpec | dict | str | Path | None = None, *,
         gpu_type: str | None = None) -> Plan:
    """Plan ``spec``: memory per GPU for every strategy, the choice, time, cost and verdict.

    ``spec`` takes the forms ``launch`` takes (a RunSpec, a mapping, a YAML path; None: the
    embedded default). ``gpu_type`` overrides ``spec.resources.gpu_type`` (which defaults to the
    detected card). Raises SpecError for an invalid spec, UnknownGPUError for a card not in the
    table, ModelNotFoundError for an unknown model.
    """
    spec = RunSpec.coerce(spec)
    gpu, on_gpu = _resolve_gpu(spec, gpu_type)
    m = spec.model
    shape = model_shape(m.id, m.revision, m.trust_remote_code)
    data = estimate_data(spec)
    p = _evaluate(spec, gpu, on_gpu, shape, data)
    p.suggestions = _suggest(spec, p, gpu, on_gpu, shape, data)
    return p


def choose_strategy(spec: RunSpec, *, gpu_type: str | None = None) -> ParallelSpec:
    """The ParallelSpec ``parallel: auto`` resolves to: the fastest strategy that fits (or the
    least memory-hungry one when none does; :func:`check_fits` then refuses the run)."""
    auto = spec.updated(**{"parallel.strategy": "auto"})
    return plan(auto, gpu_type=gpu_type).strategy.parallel_spec()


def check_fits(p: Plan) -> None:
    """Raise PlanError, saying why and what to change, unless the plan fits."""
    if p.fits:
        return
    why = "; ".join(r for r in p.reasons if "exceeds" in r or "needs" in r) or "; ".join(p.reasons)
    fixes = "\n".join(f"  * {s.text}" for s in p.suggestions)
    raise PlanError(f"this run does not fit: {why}.\nTo make it fit:\n{fixes}\n"
                    "(launch with force=True to start it anyway)")
