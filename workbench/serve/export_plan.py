"""What an export will need before it starts: disk, memory and time (:func:`plan_export`).

    >>> job.export(["merged", "gguf"], quant=["f16", "q4_k_m"], plan_only=True)  # doctest: +SKIP
    export of serve-test-... on this machine: needs about 4.2 MB disk, 1.35 GB memory, ~7.6 s (3.8 s to 23 s)
      merged/: 2.5 MB
      ...

The figures come from the base model's parameters (each tensor's shape, read from the
safetensors headers without loading them; the run's plan.json ``params`` when the weights are only
on the run's remote target) and what each step does with them: the merge loads the base in
float32 and writes the merged folder at ``dtype``; the converter writes one f16/bf16/f32 file; the
quantiser writes each type at llama.cpp's published bits per weight; each GGUF check maps its file
into a llama.cpp process while the export's own process still holds its libraries. Fixed costs
(starting processes, importing torch) were measured on the built-in tiny model, throughputs for
large models are assumptions: the time is an estimate with a range (docs/export.md#the-plan). The
export's disk check refuses with these same figures.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.serve.export_source import RunSource, base_dir, resolve_run, validate

GB = 1e9
# llama.cpp's llama-quantize lists each type with its file size for Llama-3-8B (8.03e9 parameters;
# tools/quantize/quantize.cpp, QUANT_OPTIONS: "4.58G, +0.1754 ppl @ Llama-3-8B"; G is GiB): the
# mean bits per weight over the whole file, mixed types and f32 norms included.
_LLAMA3_8B_GIB = {"q8_0": 7.96, "q4_0": 4.34, "q4_1": 4.78, "q5_0": 5.21, "q5_1": 5.65,
                  "q2_k": 2.96, "q3_k_m": 3.74, "q4_k_s": 4.37, "q4_k_m": 4.58, "q5_k_s": 5.21,
                  "q5_k_m": 5.33, "q6_k": 6.14}
BITS_PER_WEIGHT = {t: round(gib * 2**30 * 8 / 8.03e9, 2) for t, gib in _LLAMA3_8B_GIB.items()}
BITS_PER_WEIGHT.update({"f32": 32.0, "f16": 16.0, "bf16": 16.0})
# k-quants pack rows in blocks of 256 weights, the others in 32; a tensor whose rows do not divide
# is written in a fallback type instead (llama.cpp's llama_tensor_get_type: q4_k -> q5_0,
# q5_k -> q5_1, q6_k -> q8_0, q2_k/q3_k -> iq4_nl), at that type's bits per weight.
_FALLBACK_BPW = {"q2_k": 4.5, "q3_k_m": 4.5, "q4_k_s": 5.5, "q4_k_m": 5.5, "q5_k_s": 6.0,
                 "q5_k_m": 6.0, "q6_k": 8.5}
# The "_m" mixes write the output matrix as q6_k (6.5625 bits; q8_0's 8.5 where rows do not divide).
_OUTPUT_Q6K = ("q3_k_m", "q4_k_m", "q5_k_m")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# Measured here (docs/export.md#the-plan): the built-in tiny model on 2 shared CPU cores, where the
# weights are negligible, so these are each step's fixed cost and each process's resident base.
FIXED_S = {"start": 1.8, "merge": 1.8, "cast": 0.6, "check merged": 0.2, "convert": 2.9,
           "quantise": 0.2, "check gguf": 0.2, "cards": 0.1}
MAIN_RSS = 0.9 * GB  # the export's process: python + torch + transformers + peft, two models
CHILD_RSS = {"convert": 0.45 * GB, "quantise": 0.06 * GB, "check gguf": 0.12 * GB}
# Throughputs for the weight-dependent part, assumed (not measurable on the tiny model): reading,
# merging and writing float32 weights; converting to GGUF; quantising; and one greedy token, which
# reads every weight once (memory bandwidth of a CPU). The range is half to three times the
# estimate: the same export of the tiny model took from 6.5 s idle to 36 s under load here.
RATE = {"merge": 0.25 * GB, "write": 0.3 * GB, "convert": 0.2 * GB, "quantise": 0.15 * GB,
        "token": 8 * GB}
RANGE = (0.5, 3.0)


@dataclass
class ExportPlan:
    """Disk, memory and time an export needs; ``files``: each output and its planned bytes."""

    run_id: str
    formats: list[str]
    quant: list[str]
    dtype: str
    params: int
    where: str = "this machine"
    files: dict[str, int] = field(default_factory=dict)
    disk_bytes: int = 0
    memory_bytes: int = 0
    seconds: float = 0.0
    seconds_range: tuple[float, float] = (0.0, 0.0)
    steps: dict[str, float] = field(default_factory=dict)
    basis: str = ""

    def headline(self) -> str:
        """The one line the export's progress starts with."""
        lo, hi = self.seconds_range
        return (f"needs about {size_text(self.disk_bytes)} disk, {size_text(self.memory_bytes)} "
                f"memory, ~{_secs(self.seconds)} ({_secs(lo)} to {_secs(hi)})")

    def __repr__(self) -> str:
        rows = [f"export of {self.run_id} on {self.where}: {self.headline()}"]
        rows += [f"  {name}: {size_text(size)}" for name, size in self.files.items()]
        rows.append("  time: " + ", ".join(f"{k} {_secs(v)}" for k, v in self.steps.items()))
        rows.append(f"  basis: {self.basis}")
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        import html

        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{size_text(v)}</td></tr>"
                        for k, v in self.files.items())
        steps = ", ".join(f"{html.escape(k)} {_secs(v)}" for k, v in self.steps.items())
        return (f"<div><b>export of {html.escape(self.run_id)}</b> on "
                f"{html.escape(self.where)}: {html.escape(self.headline())}"
                f"<table>{cells}</table><small>time: {steps}<br>{html.escape(self.basis)}"
                "</small></div>")

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "formats": self.formats, "quant": self.quant,
                "dtype": self.dtype, "params": self.params, "where": self.where,
                "files": self.files, "disk_bytes": self.disk_bytes,
                "memory_bytes": self.memory_bytes, "seconds": round(self.seconds, 1),
                "seconds_range": [round(s, 1) for s in self.seconds_range],
                "steps": {k: round(v, 2) for k, v in self.steps.items()}}


def size_text(n: float) -> str:
    """Bytes as people read them: 2.4 MB, 1.23 GB."""
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def tensor_shapes(model_dir: Path) -> dict[str, tuple[list[int], int]]:
    """Each tensor's (shape, bytes per element) from the safetensors headers of ``model_dir``."""
    out: dict[str, tuple[list[int], int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (list(info["shape"]), _ST_BYTES.get(info["dtype"], 4))
    return out


def gguf_bytes(shapes: dict[str, tuple[list[int], int]], qtype: str) -> int:
    """Planned size of a GGUF file of ``qtype`` (tensor data; metadata is added by the caller)."""
    bits = 0.0
    for name, (shape, _) in shapes.items():
        bpw = BITS_PER_WEIGHT[qtype]
        if len(shape) < 2:
            bpw = 32.0  # norms and biases stay f32 in every type
        elif qtype in _FALLBACK_BPW or qtype in _LLAMA3_8B_GIB:
            output = name.endswith(("lm_head.weight", "output.weight"))
            if output and qtype in _OUTPUT_Q6K:
                bpw = 6.5625 if shape[-1] % 256 == 0 else 8.5
            elif shape[-1] % (256 if "_k" in qtype else 32):
                bpw = _FALLBACK_BPW.get(qtype, 16.0)
        bits += bpw * _count(shape)
    return int(bits / 8)


def _dense_shapes(params: int) -> dict[str, tuple[list[int], int]]:
    # Only the count is known (plan.json of a run on its remote target): matrices with rows of
    # 4096 (the count rounded down to a whole row; the plan keeps the exact count).
    return {"weights": ([params // 4096 or 1, 4096], 2)} if params else {}


def plan_export(run: Any, formats: Any = ("merged",), quant: Any = ("f16",),
                dtype: str = "float32", *, verify: bool = True, max_new_tokens: int = 16,
                prompts: int = 8) -> ExportPlan:
    """The disk, memory and time ``export(run, formats, quant=quant, dtype=dtype)`` needs."""
    fmts, types = validate(formats, quant, dtype)
    return plan_for(resolve_run(run), fmts, types, dtype, verify, max_new_tokens, prompts)


def plan_for(src: RunSource, fmts: list[str], types: list[str], dtype: str, verify: bool = True,
             max_new: int = 16, prompts: int = 8) -> ExportPlan:
    """:func:`plan_export` of a resolved run and checked formats (what export itself calls)."""
    plan = _plan_from(src.art, src.run_dir, src.run_id, fmts, types, dtype, verify, max_new,
                      prompts)
    plan.where = src.remote or "this machine"
    return plan


def _plan_from(art: Path, run_dir: Path, run_id: str, fmts: list[str], types: list[str],
               dtype: str, verify: bool, max_new: int, prompts: int) -> ExportPlan:
    shapes: dict[str, tuple[list[int], int]] = {}
    extra = 0  # tokenizer, config and card files that go into each folder
    basis = "tensor shapes from the base's safetensors headers"
    try:
        base = base_dir(art)
        shapes = tensor_shapes(base)
        extra = sum(p.stat().st_size for p in base.iterdir() if p.is_file()
                    and p.suffix in (".json", ".jinja", ".model", ".txt"))
    except (OSError, KeyError, ValueError, WorkbenchError):  # a base only the target has
        shapes = {}
    params = 0
    if not shapes:  # the weights are on the run's target: the count the run's plan recorded
        params = int(json.loads((run_dir / "plan.json").read_text()).get("params") or 0) if (
            run_dir / "plan.json").is_file() else 0
        shapes = _dense_shapes(params)
        extra = sum(p.stat().st_size for p in art.iterdir() if p.is_file()
                    and p.name.startswith(("tokenizer", "chat_template", "special_tokens")))
        basis = "parameter count from the run's plan.json (its weights are on its target)"
    params = params or sum(_count(s) for s, _ in shapes.values())
    f32 = params * 4
    plan = ExportPlan(run_id, fmts, types, dtype, params)
    merged = params * _DTYPE_BYTES[dtype] + extra
    plan.files["merged/"] = merged
    want_gguf = bool({"gguf", "ollama"} & set(fmts))
    floats = [t for t in types if t in ("f16", "bf16", "f32")]
    source = "f16" if "f16" in floats or not floats else floats[0]
    meta = extra  # the vocabulary and merges go into the GGUF metadata as strings
    written = merged
    if want_gguf:
        for t in dict.fromkeys([source, *types]):
            size = gguf_bytes(shapes, t) + meta
            written += size
            if t in types:
                plan.files[f"gguf/model-{t}.gguf"] = size
    if "merged" not in fmts:
        plan.files.pop("merged/")
    plan.disk_bytes = int(written)
    # Memory: the merge holds the float32 model and a serialised copy as it writes; the export's
    # process keeps its libraries (and up to one float32 copy) while each llama.cpp child runs.
    main_peak = MAIN_RSS + 2 * f32
    child = 0.0
    if want_gguf:
        biggest = max(plan.files.get(f"gguf/model-{t}.gguf", 0) for t in types)
        child = max(CHILD_RSS["convert"] + f32 / 8, CHILD_RSS["quantise"] + 2 * biggest,
                    CHILD_RSS["check gguf"] + biggest)
    plan.memory_bytes = int(max(main_peak, MAIN_RSS + f32 + child if child else 0))
    # Time: each step's fixed cost plus its bytes at the assumed rates.
    tokens = prompts * max_new
    steps = {"start": FIXED_S["start"],
             "merge": FIXED_S["merge"] + f32 / RATE["merge"] + merged / RATE["write"]}
    if dtype != "float32":
        steps["cast"] = FIXED_S["cast"] + merged / RATE["write"]
    if verify:
        steps["check merged"] = FIXED_S["check merged"] + 2 * tokens * f32 / RATE["token"]
    if want_gguf:
        n_float = len(dict.fromkeys([source, *floats]))
        src = gguf_bytes(shapes, source)
        steps["convert"] = n_float * (FIXED_S["convert"] + src / RATE["convert"])
        quants = [t for t in types if t not in ("f16", "bf16", "f32")]
        if quants:
            steps["quantise"] = len(quants) * (FIXED_S["quantise"] + src / RATE["quantise"])
        steps["check gguf"] = sum(FIXED_S["check gguf"] + (tokens if verify else 1)
                                  * plan.files[f"gguf/model-{t}.gguf"] / RATE["token"]
                                  for t in types)
    steps["cards"] = FIXED_S["cards"]
    plan.steps = steps
    plan.seconds = sum(steps.values())
    plan.seconds_range = (plan.seconds * RANGE[0], plan.seconds * RANGE[1])
    plan.basis = (f"{params / 1e6:.1f}M parameters ({basis}); sizes at llama.cpp's bits per "
                  "weight; time from fixed costs measured on the tiny model and assumed "
                  "throughputs (docs/export.md#the-plan)")
    return plan


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
