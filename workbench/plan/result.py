"""The plan: what the planner decided and why, and its views (summary, chart, HTML, plan.json).

:class:`Plan` holds the chosen strategy, its memory breakdown against the device's capacity, the
steps, hours and cost, every candidate it compared, and the suggestions (:class:`Suggestion`) that
would make a run fit or cost less. Nothing here computes an estimate; :mod:`workbench.plan.planner` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from workbench.plan.memory import MemoryBreakdown, Strategy
from workbench.plan.view import COLOURS, fmt_hours, plan_html
from workbench.runs.money import amount, money, priced, unpriced

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
    # Token statistics (TokenStats.to_dict): of a sample when planned, of all the data once
    # launch has tokenised it (plan.json is then updated with "sampled": false).
    data_tokens: dict[str, Any] | None = None
    # Seconds per start-up phase (workbench.runs.startup): paid by every attempt before its first step,
    # and part of ``cost`` (which also holds the release: exit, bundle), shown apart from training.
    startup_s: dict[str, float | None] | None = None
    startup_cost: float | None = None
    # The clock and its basis (calibration or table, earlier runs), with the modelled figures
    # before correction: workbench.plan.history compares them with what the run measured.
    clock: dict[str, Any] | None = None
    memory_seq_len: int | None = None  # tokens per sequence the activations are sized at
    wallet_note: str | None = None  # what it would hold of the wallet (workbench.runs.wallet)

    @property
    def headroom_gib(self) -> float:
        return self.capacity_gib - self.memory.total

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "model_id", "model_source", "params", "trainable_params", "gpu_type", "device",
            "devices_per_node", "nodes", "world_size", "capacity_gib", "safety_margin_gib",
            "fits", "reasons", "tokens_per_step", "steps", "total_tokens", "flops", "hours",
            "cost", "currency", "price_per_hour", "budget_limit", "budget_verdict", "data_note",
            "assumptions", "data_tokens", "startup_s", "startup_cost", "clock", "memory_seq_len",
            "wallet_note")}
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
        sized = next((a for a in self.assumptions if a.startswith("activations sized at")), None)
        if sized:
            lines.append(f"  {sized}")
        if m.host_offloaded:
            lines.append(f"  offloaded to host RAM per process: {m.host_offloaded:.2f}")
        lines.append(f"Tokens: {self.tokens_per_step:,} per step"
                     + (f", {self.total_tokens:,} over {self.steps:,} steps"
                        if self.steps else "; number of steps unknown"))
        lines.append(f"Data: {self.data_note}")
        lines += [f"  {line}" for line in token_lines(self.data_tokens)]
        if self.hours is not None:
            lines.append(f"Time: {fmt_hours(self.hours)} training ({self.flops:.3g} FLOPs)")
        fast = next((a for a in self.assumptions if a.startswith("fast paths:")), None)
        if fast and self.device == "gpu":
            lines.append(f"Fast paths: {fast.removeprefix('fast paths: ')}")
        if self.clock and self.clock.get("basis"):
            lines.append(f"Clock: {self.clock['basis']}")
        if self.clock and self.clock.get("scoring_s"):  # part of Time above
            lines.append(f"Scoring: {self.clock['scoring']}")
        if self.startup_s:
            known = {k: v for k, v in self.startup_s.items() if v}
            lines.append(f"Start-up (every attempt, billed): ~{fmt_hours(sum(known.values()) / 3600)}"
                         " (" + ", ".join(f"{k} {fmt_hours(v / 3600)}" for k, v in known.items())
                         + ")")
        unit = "GPU" if self.device == "gpu" else "core"
        if not priced(self.price_per_hour):
            setting = ("budget.price_per_gpu_hour" if self.device == "gpu"
                       else "budget.price_per_cpu_core_hour")
            lines.append(f"Cost: {unpriced(self.price_per_hour)} (the price per {unit}-hour is "
                         f"{'unknown' if self.price_per_hour is None else '0'}; set {setting} "
                         "to price this run)")
        elif self.cost is not None:
            lines.append(f"Cost: {money(self.cost, self.currency, self.price_per_hour)}"
                         + (f" ({amount(self.startup_cost, None)} of it start-up and release)"
                            if self.startup_cost else "")
                         + f" at {self.price_per_hour:g} {self.currency} per {unit}-hour")
        lines.append(f"Budget: {self.budget_verdict}"
                     + (f" (limit {self.budget_limit:,.2f} {self.currency})"
                        if self.budget_limit else ""))
        if self.wallet_note:
            lines.append(f"Wallet: {self.wallet_note}")
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
        for comp, color in zip(MemoryBreakdown.COMPONENTS, COLOURS, strict=True):
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
            title += f" | {fmt_hours(self.hours)}"
        text = money(self.cost, self.currency, self.price_per_hour)
        if text is not None:
            title += f" | {text}"
        ax.set_title(title)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize="small",
                  frameon=False)
        fig.subplots_adjust(bottom=0.45)
        return fig

    def _repr_html_(self) -> str:
        return plan_html(self)


def token_lines(tokens: dict[str, Any] | None) -> list[str]:
    """Per split: token lengths against max_length, truncated and dropped examples (plan.json's
    ``data_tokens``), e.g. 'train (sample): 461 examples, tokens median 24, p95 31, max 40 ...'."""
    if not tokens:
        return []
    out = []
    kind = " (sample)" if tokens.get("sampled") else ""
    for name, s in tokens.get("splits", {}).items():
        if not s.get("examples"):
            continue
        t = s.get("tokens") or {}
        out.append(f"{name}{kind}: {s['examples']:,} examples, tokens median {t.get('median')}, "
                   f"p95 {t.get('p95')}, max {t.get('max')} (max_length {tokens['max_length']}); "
                   f"{s['truncated']:,} truncated, {s['dropped']:,} dropped; "
                   f"{s['trainable_tokens']:,} trained tokens")
    return out


def _fmt_count(n: float) -> str:
    """6.74B, 4.19M, 609K, 512: a parameter count the way model cards write it."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"
