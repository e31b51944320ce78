"""Matplotlib figures shared by the widgets, Job.plot() and the headless demo.

Figures are built without pyplot (no global figure registry, no GUI backend, safe from a
widget's thread), so nothing registers a display formatter for them: :class:`LossFigure`
carries its own ``_repr_png_``, which JupyterLab, ``nbconvert --to html`` and the demo's
image export all read.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure


class LossFigure(Figure):
    """A Figure that shows itself as a PNG wherever IPython displays it.

        >>> fig = loss_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
        >>> fig._repr_png_()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def loss_figure(metrics: list[dict[str, Any]], title: str = "", ax: Any = None,
                figsize: tuple[float, float] = (6.0, 3.2)) -> Any:
    """Train and eval loss against step. Returns the Figure (not shown: the caller decides).

    Without ``ax`` it is a :class:`LossFigure` (displays as a PNG); with ``ax`` it is the
    figure that axis belongs to.
    """
    if ax is None:
        fig = LossFigure(figsize=figsize, dpi=90)
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()

