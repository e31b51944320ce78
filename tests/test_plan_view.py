"""The plan as a notebook shows it (issue 37, item 5): a rounded headline, a memory bar against the
card, the one reason that matters, the full text behind a toggle. Planned offline, no GPU."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from workbench.plan import plan
from workbench.spec import RunSpec


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class _Page(HTMLParser):
    """The text outside and inside <details>, and each memory segment's title and width."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: list[str] = []
        self.inside: list[str] = []
        self.segments: list[tuple[str, float]] = []
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "details":
            self.depth += 1
        m = re.search(r"width:([\d.]+)%", a.get("style") or "")
        if m and re.fullmatch(r"\w+ [\d.]+ GiB", a.get("title") or ""):
            self.segments.append((a["title"], float(m.group(1))))

    def handle_endtag(self, tag):
        if tag == "details":
            self.depth -= 1

    def handle_data(self, data):
        (self.inside if self.depth else self.outside).append(data)


def _page(p) -> _Page:
    page = _Page()
    page.feed(p._repr_html_())
    return page


def _gpu_plan(model: str, gpu: str, kind: str = "lora", **more):
    return plan(RunSpec.parse({
        "model": {"id": model}, "method": {"kind": kind}, **more,
        "train": {"batch_size": 2, "gradient_checkpointing": True, "max_steps": 100},
        "data": {"max_length": 2048, "packing": True},
        "resources": {"gpus_per_node": 1, "gpu_type": gpu},
        "budget": {"price_per_gpu_hour": 2.0, "currency": "CNY"}}))


def test_a_fitting_plan_reads_in_a_line_with_the_full_text_behind_a_toggle():
    p = _gpu_plan("meta-llama/Llama-3.1-8B", "RTX 4090")
    page = _page(p)
    shown = " ".join(t.strip() for t in page.outside if t.strip())
    assert shown.startswith("fits · ")
    assert "CNY" in shown and re.search(r"\d+ (s|min|h)\b", shown)
    assert "21.035" not in shown and not re.search(r"\d\.\d{3,}", shown)  # rounded for reading
    # The whole summary is there, a click away, not on the page.
    full = "".join(page.inside)
    assert p.summary().strip() in full
    assert "Memory per GPU (GiB):" not in shown


def test_the_memory_bar_is_the_plan_against_the_card():
    p = _gpu_plan("meta-llama/Llama-3.1-8B", "RTX 4090")
    segments = _page(p).segments
    assert len(segments) >= 3
    gib = [float(t.split()[1]) for t, _ in segments]
    widths = [w for _, w in segments]
    # Each segment's width is its share of the 24 GiB card (the plan fits, so the card is the
    # bar's full width): GiB / 24 x 100, read back from the segment's own title.
    for g, w in zip(gib, widths, strict=True):
        assert w == pytest.approx(g / p.capacity_gib * 100, abs=0.05)
    assert sum(widths) < 100


def test_a_plan_that_does_not_fit_leads_with_why():
    p = _gpu_plan("meta-llama/Llama-3.1-70B", "RTX 4090", kind="full",
                  parallel={"strategy": "ddp"})  # no ZeRO, no offload: 70B on one 24 GB card
    assert not p.fits
    page = _page(p)
    shown = [t.strip() for t in page.outside if t.strip()]
    assert shown[0].startswith("does not fit · ")
    # Why, in the card's own numbers, before anything else.
    assert any(t.startswith(f"needs {p.memory.total:.1f} GiB per GPU; RTX 4090 has 24 GiB")
               for t in shown), shown
    # Wider than the card: the bar's scale is the plan, so the card's mark sits inside it.
    assert sum(w for _, w in page.segments) == pytest.approx(100, abs=0.1)
