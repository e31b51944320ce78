"""How a plan shows in a notebook: a few rounded facts and a memory bar, the full text a click away.

:func:`plan_html` is :class:`~workbench.plan.result.Plan`'s rich view: one headline (fits or not,
the strategy, time, cost against the budget), a bar of memory per GPU (or per process) by
component against the card's capacity and its safety margin, the one reason that matters most
(why it does not fit, why it is over budget, or why this strategy), what the wallet would hold,
and the whole :meth:`Plan.summary` text behind a ``<details>`` toggle. Plain HTML and inline
styles: it renders in JupyterLab, in nbviewer and in an exported notebook, with no JavaScript.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from workbench.runs.money import money

if TYPE_CHECKING:
    from workbench.plan.result import Plan

# One colour per memory component, in MemoryBreakdown.COMPONENTS order (the bar here, Plan.plot).
COLOURS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#8c8c8c")


def fmt_hours(hours: float) -> str:
    """6 s, 12 min, 1.5 h: a duration as people read it."""
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h"


def headline(plan: Plan) -> str:
    """'fits · LoRA, DDP · 3 min · 0.42 CNY (within budget)', rounded for reading; the money
    as every view writes it (:func:`workbench.runs.money.money`): 'free', 'no price set'."""
    parts = ["fits" if plan.fits else "does not fit", plan.strategy.label]
    if plan.hours is not None:
        parts.append(fmt_hours(plan.hours))
    text = money(plan.cost, plan.currency, plan.price_per_hour)  # 'free' on an unpriced run
    if text is not None:
        if plan.budget_verdict in ("within budget", "over budget"):
            text += f" ({plan.budget_verdict})"
        parts.append(text)
    return " · ".join(parts)


def main_reason(plan: Plan) -> str | None:
    """The one thing a reader should know first: why it does not fit, why it is over budget, or
    the first reason the planner gives."""
    if not plan.fits:
        unit = "GPU" if plan.device == "gpu" else "process"
        where = plan.gpu_type if plan.device == "gpu" else "this machine's memory share"
        why = (f"needs {plan.memory.total:.1f} GiB per {unit}; {where} has "
               f"{plan.capacity_gib:.0f} GiB (keeping {plan.safety_margin_gib:.1f} free)")
        return f"{why}; {plan.suggestions[0].text}" if plan.suggestions else why
    if plan.budget_verdict == "over budget" and plan.budget_limit is not None:
        return (f"over budget: planned {money(plan.cost, plan.currency, plan.price_per_hour)} "
                f"against a limit of {plan.budget_limit:,.2f}")
    return plan.reasons[0] if plan.reasons else None


def memory_bar(plan: Plan) -> str:
    """A stacked bar, as wide as the larger of the card and the plan, with the capacity and
    the safety margin marked; each segment's title gives its GiB."""
    from workbench.plan.memory import MemoryBreakdown

    total = plan.memory.total
    scale = max(plan.capacity_gib, total) or 1.0
    segments = []
    for comp, colour in zip(MemoryBreakdown.COMPONENTS, COLOURS, strict=True):
        gib = getattr(plan.memory, comp)
        if gib <= 0:
            continue
        width = 100 * gib / scale
        segments.append(f"<div title='{comp} {gib:.2f} GiB' style='width:{width:.2f}%;"
                        f"background:{colour};height:100%'></div>")
    cap = 100 * plan.capacity_gib / scale
    margin = 100 * (plan.capacity_gib - plan.safety_margin_gib) / scale
    unit = "GPU" if plan.device == "gpu" else "process"
    what = plan.gpu_type if plan.device == "gpu" else "host RAM"
    legend = " ".join(
        f"<span style='color:{c}'>&#9632;</span> {n} {getattr(plan.memory, n):.1f}"
        for n, c in zip(MemoryBreakdown.COMPONENTS, COLOURS, strict=True)
        if getattr(plan.memory, n) > 0)
    return (f"<div class='wb-plan-memory' style='margin:4px 0'>"
            f"<div style='font-size:90%'>memory per {unit}: {total:.1f} of "
            f"{plan.capacity_gib:.0f} GiB ({html.escape(what)})</div>"
            f"<div style='position:relative;display:flex;height:14px;width:100%;max-width:480px;"
            f"background:#eee;border-radius:2px'>{''.join(segments)}"
            f"<div title='keep {plan.safety_margin_gib:.1f} GiB free' style='position:absolute;"
            f"left:{margin:.2f}%;top:0;bottom:0;border-left:1px dashed #000'></div>"
            f"<div title='{plan.capacity_gib:.1f} GiB' style='position:absolute;left:{cap:.2f}%;"
            f"top:-2px;bottom:-2px;border-left:2px solid #000'></div></div>"
            f"<div style='font-size:80%;color:#555'>{legend} GiB</div></div>")


def plan_html(plan: Plan) -> str:
    colour = "#1a7f37" if plan.fits else "#cf222e"
    head = html.escape(headline(plan))
    rows = [f"<div class='wb-plan-head' style='font-weight:600;color:{colour}'>{head}</div>",
            memory_bar(plan)]
    reason = main_reason(plan)
    if reason:
        rows.append(f"<div class='wb-plan-reason'>{html.escape(reason)}</div>")
    if plan.wallet_note:
        rows.append(f"<div class='wb-plan-wallet'>wallet: {html.escape(plan.wallet_note)}</div>")
    rows.append("<details><summary>full plan</summary>"
                f"<pre>{html.escape(plan.summary())}</pre></details>")
    return f"<div class='wb-plan'>{''.join(rows)}</div>"
