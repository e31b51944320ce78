"""Matplotlib figures shared by the widgets, Job.plot() and the headless demo."""

from __future__ import annotations

from typing import Any


def loss_figure(metrics: list[dict[str, Any]], title: str = "", ax: Any = None,
                figsize: tuple[float, float] = (6.0, 3.2)) -> Any:
    """Train and eval loss against step. Returns the Figure (not shown: the caller decides)."""
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=figsize, dpi=90)
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    evals = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    if train:
        ax.plot(*zip(*train), label="train loss", color="#1f77b4", linewidth=1.5)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", color="#d62728", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title, fontsize=9)
    if train or evals:
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "waiting for the first step…", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_png(fig: Any) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
