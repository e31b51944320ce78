"""Memory: the peak bytes per GPU (or CPU process) of one training strategy, and the strategies.

:func:`estimate_memory` adds up weights, gradients, optimizer states, activations, logits and
fixed overheads for a :class:`Strategy` (method x data-parallel sharing x offload x optimizer) on a
:class:`_Setup` (model shape, batch, sequence length, world size); :func:`all_strategies` lists
the combinations the planner compares. Sources and measured tolerances: ``docs/planning.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

from workbench.plan.shape import ModelShape
from workbench.spec import ParallelSpec

GiB = 2**30
Method = Literal["lora", "qlora", "full"]
Parallel = Literal["ddp", "zero1", "zero2", "zero3"]
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit"]


# bitsandbytes NF4 with double quantisation (QLoRA, Dettmers et al. 2023, sec. 3): 4 bits per
# weight + 8-bit absmax per 64 weights + fp32 second-level constant per 256 blocks
# = 4 + 8/64 + 32/(64*256) = 4.127 bits. LLM.int8: 8 bits + one fp32 scale per row (negligible).
_QUANT_BYTES = {"4bit": 4.127 / 8, "8bit": 1.0}
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers that torch's allocator does not count,
# plus allocator fragmentation; the context alone takes up to ~0.9 GiB on A100/H100
# (docs/planning.md).
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
# Adam state per trainable parameter: two fp32 moments; bitsandbytes' 8-bit AdamW keeps them in
# one byte each, block-wise quantised with an fp32 absmax per block of 256 values
# (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"; bitsandbytes'
# Optimizer8bit blocksize).
_ADAM_STATE_BYTES = {"adamw": 8.0, "adamw_8bit": 2 + 2 * 4 / 256,
                     "paged_adamw_8bit": 2 + 2 * 4 / 256}


@dataclass(frozen=True)
class Strategy:
    """How a run is trained: method and how the data-parallel replicas share model states."""

    method: Method
    parallel: Parallel
    offload_optimizer: bool = False
    offload_params: bool = False
    optimizer: Optimizer = "adamw"  # train.optimizer as the trainer will run it
    # Each parameter stepped from its gradient hook in backward, its gradient freed at once
    # (train.optimizer_in_backward), and full fine-tuning's weights in bf16 without an fp32
    # master copy (train.master_weights; workbench.spec.precision).
    in_backward: bool = False
    weights_16bit: bool = False

    @property
    def label(self) -> str:
        extra = []
        if self.offload_optimizer:
            extra.append("optimizer")
        if self.offload_params:
            extra.append("params")
        off = f" + offload {' & '.join(extra)}" if extra else ""
        optim = {"adamw_8bit": " + 8-bit adamw", "paged_adamw_8bit": " + paged 8-bit adamw"}
        label = f"{self.method} + {self.parallel}{off}{optim.get(self.optimizer, ' + adamw')}"
        if not (self.in_backward or self.weights_16bit):
            return label.removesuffix(" + adamw")
        return (label + (" in backward" if self.in_backward else "")
                + (", bf16 weights" if self.weights_16bit else ""))

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
    # A paged optimizer's states (bitsandbytes, CUDA unified memory): outside torch's allocator
    # and not in `total`; the driver keeps on the card what its free memory holds and pages the
    # rest through host RAM (:func:`paged_spill_gib`).
    paged: float = 0.0

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
    # What from_pretrained loads (workbench.spec.precision): fp32 master weights for full fine-tuning.
    load_bytes: int = 4
    # The fast paths the trainer turns on for this strategy (workbench.train.fastpath): Liger's
    # fused linear cross-entropy (no logits materialised), its RMSNorm/SwiGLU kernels, and eager
    # attention (which keeps the attention scores; flash and SDPA do not).
    fused_loss: bool = False
    liger: bool = False
    flash_attention: bool = False
    eager_attention: bool = False
    # Each parameter's optimizer step runs as soon as its gradient is accumulated, and the
    # gradient is freed (train.optimizer_in_backward; a strategy's Strategy.in_backward sets it).
    optimizer_in_backward: bool = False


def _loss_bytes(s: _Setup, logit_bytes: float) -> float:
    """What the loss holds at the start of backward, for one micro-batch.

    Liger's fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``) computes the
    logits a chunk of tokens at a time, chunk = the power of two at or above
    tokens / ceil(vocab / hidden), and keeps only the input's gradient (tokens x h, compute
    dtype) plus one chunk's logits and their fp32 working copy. Otherwise ``logit_bytes`` per
    token x vocab entry (12 for transformers' fp32 cross-entropy)."""
    tokens = s.micro_batch * s.seq_len
    vocab = s.shape.vocab
    if not s.fused_loss:
        return tokens * vocab * logit_bytes
    per_chunk = max(1, math.ceil(tokens / math.ceil(vocab / s.shape.hidden)))
    chunk = 2 ** math.ceil(math.log2(per_chunk))
    return tokens * s.shape.hidden * s.compute_bytes + chunk * vocab * (s.compute_bytes + 4)


def _activation_bytes(s: _Setup, checkpointing: bool, logit_bytes: float = 0.0) -> float:
    """Peak activation bytes of one micro-batch (flash/SDPA attention, no dropout).

    Per layer and token, autograd keeps (in compute dtype b unless noted): the two RMSNorm inputs
    in fp32 (transformers upcasts them), the attention block's norm output, q, k, v (k/v repeated
    to full width for GQA), the attention output and the o_proj input (~6h), and the MLP's norm
    output, gate, SiLU(gate), up and their product (h + 4f). This adapts Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", sec. 4.1, 34·s·b·h bytes per
    layer for GPT) to Llama's SwiGLU MLP and fp32 norms, without the attention-score term that
    flash attention removes.

    The loss holds what :func:`_loss_bytes` says at the start of backward, when (without
    checkpointing) every layer's activations are still alive. With gradient checkpointing only
    each layer's input (b·h) is kept; the loss buffers are freed before the first layer is
    recomputed, so the peak is the larger of the two moments, not their sum. Backward through a
    layer briefly adds gradient tensors (~3f + 2h per token).
    """
    tokens = s.micro_batch * s.seq_len
    b = s.compute_bytes
    h, f = s.shape.hidden, s.shape.intermediate
    per_layer: float
    if s.liger:
        # Liger's RMSNorm saves its input in the compute dtype (and a per-row rstd), its SwiGLU
        # saves gate and up and recomputes SiLU in backward: per layer two norm inputs and
        # outputs, q, k, v, the attention output (= o_proj's input), gate, up and their product.
        # flash-attention 2 takes k/v at their GQA width; SDPA gets them repeated to full width.
        kv = s.shape.kv_heads / s.shape.heads if s.flash_attention else 1.0
        per_layer = tokens * b * ((6 + 2 * kv) * h + 3 * f)
    else:
        per_layer = tokens * (b * (7 * h + 4 * f) + 2 * 4 * h)
    if s.eager_attention:
        # Eager attention keeps the softmax probabilities (and their input) per head: seq^2 each.
        per_layer += s.micro_batch * s.shape.heads * s.seq_len**2 * 2 * b
    backward_transient = tokens * b * (3 * f + 2 * h)
    logits = _loss_bytes(s, logit_bytes)
    embeddings_and_final_norm = tokens * h * (b + 4)
    if checkpointing:
        kept: float = s.shape.layers * tokens * h * b
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
    cross-entropy; with ``s.fused_loss`` (Liger's fused linear cross-entropy) it is not used.

    An 8-bit AdamW (bitsandbytes, without DeepSpeed) keeps ~2 B of state per trainable parameter
    instead of 8; a paged one keeps it in unified memory (``paged``, outside ``total``). With the
    optimizer stepped in backward (``st.in_backward``, or ``s.optimizer_in_backward``) only the
    largest parameter's gradient is alive at once; with ``st.weights_16bit`` a full fine-tune's
    weights (and so its gradients) are in the compute dtype, without an fp32 master copy."""
    if st.weights_16bit or st.in_backward:
        s = replace(s, load_bytes=s.compute_bytes if st.weights_16bit else s.load_bytes,
                    optimizer_in_backward=s.optimizer_in_backward or st.in_backward)
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
        # torch AMP over fp32 weights (workbench.spec.precision): the fp32 parameters are the weights;
        # autocast keeps a 16-bit copy of each weight until backward has used it.
        weights = p * s.load_bytes + (p * b if b < s.load_bytes else 0)
    elif z3:
        # One layer's weights + their gradients (a frozen layer, LoRA's base, has none).
        gathered = (2 if full else 1) * b * sh.largest_layer_params
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
            grads = t * s.load_bytes
        else:
            # peft keeps adapters in fp32 (autocast_adapter_dtype), so their grads are fp32 too.
            trainable = t * 4
            grads = t * 4
        optim = t * _ADAM_STATE_BYTES[st.optimizer]
        if s.optimizer_in_backward:
            grads = min(grads, sh.largest_layer_params * grads / t) if t else grads
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

    paged = 0.0
    if st.optimizer == "paged_adamw_8bit":
        paged, optim = optim, 0.0

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
        host_offloaded=host / GiB, paged=paged / GiB,
    )


def paged_spill_gib(mem: MemoryBreakdown, capacity_gib: float) -> float:
    """GiB of a paged optimizer's states that do not fit beside the rest on the card: they live
    in host RAM and cross PCIe every step, in as the update reads them and out as newer pages
    evict them."""
    return max(0.0, mem.paged - max(0.0, capacity_gib - mem.total))


def unsupported(st: Strategy) -> str | None:
    """Why the trainer cannot run ``st`` (None: it can). Such a strategy is never chosen."""
    if st.optimizer != "adamw" and (st.parallel != "ddp" or st.offload_optimizer):
        return (f"train.optimizer {st.optimizer} runs without DeepSpeed (ZeRO steps its own "
                "optimizer): use parallel.strategy ddp or auto")
    if (st.in_backward or st.weights_16bit) and (st.parallel != "ddp" or st.offload_optimizer):
        return ("the optimizer in backward and pure bf16 weights run without DeepSpeed (ZeRO "
                "steps its own optimizer over its own fp32 masters): use parallel.strategy ddp")
    if st.method == "qlora" and st.parallel == "zero3":
        # bitsandbytes 4-bit weights are placed whole on each GPU (device_map) and are not
        # parameters ZeRO-3 can partition; transformers skips zero.Init for quantised models.
        return ("QLoRA cannot use ZeRO-3: it needs every GPU to hold the whole 4-bit model, "
                "which ZeRO-3 cannot partition; use parallel.strategy: zero2 or auto")
    return None


def safety_margin_gib(capacity_gib: float) -> float:
    """Headroom kept free: 8% of the card, at least 2 GiB (6.4 GiB on an 80 GB card)."""
    return max(2.0, 0.08 * capacity_gib)


def all_strategies(world: int, optimizers: tuple[Optimizer, ...] = ("adamw",),
                   steppings: tuple[tuple[bool, bool], ...] = ((False, False),)
                   ) -> list[Strategy]:
    """Every valid combination, cheapest first within each method (ZeRO shards need world > 1,
    offloading is what you pay for when nothing else fits). ``optimizers``: those the run may
    step; an 8-bit one runs under DDP only, and DeepSpeed's offload steps its own.
    ``steppings``: the (optimizer in backward, bf16 weights) pairs a full fine-tune may run
    with; any but (False, False) runs under DDP only, with each optimizer."""
    out: list[Strategy] = []
    for method in ("full", "lora", "qlora"):
        plain = method != "full" or (False, False) in steppings
        if plain and "adamw" in optimizers:
            out.append(Strategy(method, "ddp"))
            if world > 1:
                out += [Strategy(method, "zero1"), Strategy(method, "zero2"),
                        Strategy(method, "zero3")]
        if plain:
            out += [Strategy(method, "ddp", optimizer=o) for o in optimizers if o != "adamw"]
        if method == "full":
            out += [Strategy(method, "ddp", optimizer=o, in_backward=ib, weights_16bit=w16)
                    for ib, w16 in steppings if ib or w16 for o in optimizers]
        if not plain or "adamw" not in optimizers:
            continue
        out += [Strategy(method, "zero2", offload_optimizer=True),
                Strategy(method, "zero3", offload_optimizer=True),
                Strategy(method, "zero3", offload_optimizer=True, offload_params=True)]
    return out
