"""What a cleaning run removed and why: per-step counts, reasons, examples, length histograms and
the language mix, as JSON on disk, a text summary, a matplotlib figure and a notebook widget.
For near-duplicates it names, for every removed document, the kept document it duplicates and
their Jaccard similarity (``StepReport.duplicates``); the widget shows example pairs side by side
and the figure a histogram of those similarities.

    >>> r = CleanReport.start([], ["text"], "demo", workers=1, examples=2)
    >>> r.record_kept("hello", "hello", "en", [], {}); r.finish(0.1)
    >>> r.to_dict()["documents_out"]
    1
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.data.clean.diffview import marked, window

if TYPE_CHECKING:
    from workbench.data.clean.near_index import NearMatch

#: Kept documents whose first characters are remembered so that an example near-duplicate can be
#: shown next to the document it duplicates (only until the examples are complete).
KEPT_TEXT_LIMIT = 20_000
#: Length histogram bins: bin 0 holds empty texts, bin k holds lengths in [2^(k-1), 2^k),
#: the last bin everything from 2^20 characters up.
N_BINS = 22


def length_bin(n: int) -> int:
    return min(n.bit_length(), N_BINS - 1)


def bin_labels() -> list[str]:
    labels = ["0"] + [f"{2 ** (k - 1)}-{2 ** k - 1}" for k in range(1, N_BINS - 1)]
    return labels + [f">={2 ** (N_BINS - 2)}"]


@dataclass
class StepReport:
    """Counts for one step: documents removed (by reason), rewritten, and example removals.

    ``duplicates`` (near dedup) holds one ``(row, kept_row, similarity, method)`` per removed
    document: input rows are 1-based positions in the input, ``method`` is "exact" or
    "estimated" (see :mod:`workbench.data.clean.near_index`).
    """

    name: str
    params: dict[str, Any]
    removed: int = 0
    modified: int = 0
    reasons: Counter = field(default_factory=Counter)
    replacements: Counter = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)
    duplicates: list[tuple[int, int, float, str]] = field(default_factory=list)
    # Example rewrites (PII, normalize): the text around the first change, before and after.
    rewrites: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params, "removed": self.removed,
                "modified": self.modified, "reasons": dict(self.reasons),
                "replacements": dict(self.replacements), "examples": self.examples,
                "rewrites": self.rewrites,
                "duplicates": [{"row": r, "kept_row": k, "similarity": sim, "method": m}
                               for r, k, sim, m in self.duplicates]}

    def similarities(self) -> list[float]:
        """Similarity of each removed near-duplicate to the kept document it duplicates."""
        return [d[2] for d in self.duplicates]


class CleanReport:
    """The report of one cleaning run; filled while the run's iterator is consumed."""

    def __init__(self, steps: list[StepReport], text_fields: list[str], source: str,
                 workers: int, examples: int) -> None:
        self.steps = steps
        self.text_fields = text_fields
        self.source = source
        self.workers = workers
        self.max_examples = examples
        self.documents_in = self.documents_out = 0
        self.chars_in = self.chars_out = 0
        self.hist_in = [0] * N_BINS
        self.hist_out = [0] * N_BINS
        self.languages_in: Counter = Counter()
        self.languages_out: Counter = Counter()
        self.seconds = 0.0
        self.complete = False
        self._kept_text: dict[int, str] = {}

    @classmethod
    def start(cls, steps: Sequence[Any], text_fields: list[str], source: str, workers: int,
              examples: int) -> CleanReport:
        reports = [StepReport(s.name, _jsonable(s.params())) for s in steps]
        return cls(reports, text_fields, source, workers, examples)

    # ---- filled by the pipeline ----------------------------------------------------------------

    def _count_in(self, text: str, lang: str | None) -> None:
        self.documents_in += 1
        self.chars_in += len(text)
        self.hist_in[length_bin(len(text))] += 1
        if lang is not None:
            self.languages_in[lang] += 1

    def _wants_examples(self, s: StepReport, reason: str) -> bool:
        return sum(e["reason"] == reason for e in s.examples) < self.max_examples

    def record_indexed(self, step: int, row: int, text: str) -> None:
        """A document passed the near-dedup step ``step``: remember its start while examples
        of that step may still need it as the kept side of a pair."""
        if (self._wants_examples(self.steps[step], "duplicate")
                and len(self._kept_text) < KEPT_TEXT_LIMIT):
            self._kept_text[row] = _snippet(text)

    def record_removed(self, step: int, reason: str, detail: str, text: str, lang: str | None,
                       modified: Sequence[int], row: int | None = None,
                       match: NearMatch | None = None) -> None:
        self._count_in(text, lang)
        for m in modified:
            self.steps[m].modified += 1
        s = self.steps[step]
        s.removed += 1
        s.reasons[reason] += 1
        if match is not None and row is not None:
            s.duplicates.append((row, match.kept_row, round(match.similarity, 4), match.method))
        if self._wants_examples(s, reason):
            example: dict[str, Any] = {"reason": reason, "detail": detail, "lang": lang,
                                       "text": _snippet(text)}
            if match is not None:
                example.update(row=row, kept_row=match.kept_row,
                               similarity=round(match.similarity, 4), method=match.method,
                               kept_text=self._kept_text.get(match.kept_row))
            s.examples.append(example)
            if match is not None and not self._wants_examples(s, reason):
                self._kept_text.clear()  # the examples are complete: free the snippets

    def record_kept(self, text_in: str, text_out: str, lang: str | None,
                    modified: Sequence[int], replacements: dict[str, int]) -> None:
        self._count_in(text_in, lang)
        self.documents_out += 1
        self.chars_out += len(text_out)
        self.hist_out[length_bin(len(text_out))] += 1
        if lang is not None:
            self.languages_out[lang] += 1
        for m in modified:
            self.steps[m].modified += 1
            step = self.steps[m]
            if text_in != text_out and len(step.rewrites) < self.max_examples:
                before, after = window(text_in, text_out)
                step.rewrites.append({"before": before, "after": after})
        if replacements:
            for s in self.steps:
                if s.name == "pii":
                    s.replacements.update(replacements)

    def finish(self, seconds: float) -> None:
        self.seconds = seconds
        self.complete = True

    # ---- views ---------------------------------------------------------------------------------

    @property
    def removed(self) -> int:
        return self.documents_in - self.documents_out

    def step(self, name: str) -> StepReport:
        """The counts of the step called ``name`` (KeyError if the run had no such step)."""
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step {name!r} in this run; steps: {[s.name for s in self.steps]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1, "source": self.source, "text_fields": self.text_fields,
            "complete": self.complete, "documents_in": self.documents_in,
            "documents_out": self.documents_out, "removed": self.removed,
            "chars_in": self.chars_in, "chars_out": self.chars_out,
            "seconds": round(self.seconds, 3), "workers": self.workers,
            "docs_per_second": round(self.documents_in / self.seconds, 1) if self.seconds else None,
            "steps": [s.to_dict() for s in self.steps],
            "languages_in": dict(self.languages_in.most_common()),
            "languages_out": dict(self.languages_out.most_common()),
            "length_histogram": {"unit": "characters", "bins": bin_labels(),
                                 "in": self.hist_in, "out": self.hist_out},
        }

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n",
                        encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CleanReport:
        steps = [StepReport(s["name"], s["params"], s["removed"], s["modified"],
                            Counter(s["reasons"]), Counter(s.get("replacements", {})),
                            s["examples"],
                            [(x["row"], x["kept_row"], x["similarity"], x["method"])
                             for x in s.get("duplicates", [])], s.get("rewrites", []))
                 for s in d["steps"]]
        r = cls(steps, d["text_fields"], d["source"], d["workers"], 0)
        r.documents_in, r.documents_out = d["documents_in"], d["documents_out"]
        r.chars_in, r.chars_out = d["chars_in"], d["chars_out"]
        r.hist_in, r.hist_out = d["length_histogram"]["in"], d["length_histogram"]["out"]
        r.languages_in, r.languages_out = Counter(d["languages_in"]), Counter(d["languages_out"])
        r.seconds, r.complete = d["seconds"], d["complete"]
        return r

    @classmethod
    def load(cls, path: str | Path) -> CleanReport:
        """Read a report written by :meth:`to_json` (e.g. by ``workbench data clean``)."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def summary(self) -> str:
        """A plain-text table: one line per step with what it removed and why."""
        lines = [f"{self.documents_in} documents in, {self.documents_out} kept, "
                 f"{self.removed} removed"]
        for s in self.steps:
            why = ", ".join(f"{k} {v}" for k, v in s.reasons.most_common())
            extra = f", rewrote {s.modified}" if s.modified else ""
            if s.replacements:
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.replacements.items()))
                extra += f" ({kinds})"
            why = f"  [{why}]" if why else ""
            lines.append(f"  {s.name:<12} removed {s.removed:>7}{extra}{why}")
            if s.duplicates:
                sims = sorted(s.similarities())
                methods = Counter(d[3] for d in s.duplicates)
                lines.append(f"  {'':<12} Jaccard with the kept document: min {sims[0]:.2f}, "
                             f"median {sims[len(sims) // 2]:.2f} ("
                             + ", ".join(f"{k} {v}" for k, v in sorted(methods.items())) + ")")
        if self.languages_in:
            lines.append("  languages: " + ", ".join(
                f"{k} {v}" for k, v in self.languages_in.most_common(6)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<CleanReport {self.documents_in} in, {self.documents_out} kept>"

    def plot(self) -> Any:
        """A matplotlib figure: removals per step, length histograms in/out, language mix and,
        when near-duplicates were removed, a histogram of their similarities."""
        import matplotlib.pyplot as plt

        sims = [x for s in self.steps for x in s.similarities()]
        fig, axes = plt.subplots(1, 4 if sims else 3, figsize=(18 if sims else 14, 3.6))
        ax = axes[0]
        names = [s.name for s in self.steps]
        ax.barh(names[::-1], [s.removed for s in self.steps][::-1], color="#c0504d")
        ax.set_title("documents removed per step")
        ax = axes[1]
        used = [i for i in range(N_BINS) if self.hist_in[i] or self.hist_out[i]] or [0]
        lo, hi = min(used), max(used) + 1
        xs = list(range(lo, hi))
        labels = bin_labels()[lo:hi]
        ax.bar([x - 0.2 for x in xs], self.hist_in[lo:hi], width=0.4, label="in")
        ax.bar([x + 0.2 for x in xs], self.hist_out[lo:hi], width=0.4, label="kept")
        ax.set_xticks(xs, labels, rotation=45, ha="right", fontsize=7)
        ax.set_title("length (characters)")
        ax.legend()
        ax = axes[2]
        langs = [k for k, _ in self.languages_in.most_common(8)]
        ax.bar([x - 0.2 for x in range(len(langs))], [self.languages_in[k] for k in langs],
               width=0.4, label="in")
        ax.bar([x + 0.2 for x in range(len(langs))], [self.languages_out[k] for k in langs],
               width=0.4, label="kept")
        ax.set_xticks(range(len(langs)), langs)
        ax.set_title("language mix")
        if langs:
            ax.legend()
        if sims:
            ax = axes[3]
            ax.hist(sims, bins=[i / 40 for i in range(41)], color="#4f81bd")
            ax.set_xlim(min(0.5, min(sims) - 0.05), 1.0)
            ax.set_xlabel("Jaccard similarity with the kept document")
            ax.set_title(f"near-duplicates removed ({len(sims)})")
        fig.tight_layout()
        return fig

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(s.name)}</td><td>{s.removed}</td><td>{s.modified}</td>"
            f"<td>{html.escape(', '.join(f'{k}: {v}' for k, v in s.reasons.most_common()))}"
            f"{html.escape(''.join(f' {k}: {v}' for k, v in sorted(s.replacements.items())))}"
            f"</td></tr>" for s in self.steps)
        return (f"<p><b>{self.documents_in}</b> documents in, <b>{self.documents_out}</b> kept, "
                f"{self.removed} removed in {self.seconds:.1f} s</p>"
                "<table><tr><th>step</th><th>removed</th><th>rewritten</th><th>why</th></tr>"
                f"{rows}</table>")

    def widget(self) -> Any:
        """An ipywidgets view: summary table, the :meth:`plot` figure, examples per step."""
        import ipywidgets as w
        import matplotlib.pyplot as plt

        plot_out = w.Output()
        with plot_out:
            fig = self.plot()
            plt.show(fig)
        pages = []
        for s in self.steps:
            items = "".join(
                f"<li><code>{html.escape(e['reason'])}</code> {html.escape(e['detail'])}<br>"
                f"<span style='color:#555'>{html.escape(e['text'])}</span></li>"
                for e in s.examples) or "<li>nothing removed</li>"
            pages.append(w.HTML(f"<ul>{items}</ul>"))
        examples = w.Accordion(children=pages)
        for i, s in enumerate(self.steps):
            examples.set_title(i, f"{s.name}: {s.removed} removed")
        parts = [w.HTML(self._repr_html_()), plot_out,
                 w.HTML("<b>Examples of removed documents</b>"), examples]
        rewrites = self.rewrites_html()
        if rewrites:
            parts += [w.HTML("<b>Rewrites: before and after</b>"), w.HTML(rewrites)]
        pairs = self.pairs_html()
        if pairs:
            parts += [w.HTML("<b>Near-duplicates next to the document they duplicate</b>"),
                      w.HTML(pairs)]
        return w.VBox(parts)

    def rewrites_html(self) -> str:
        """Example rewrites of each step that changes text (PII, normalize), before | after,
        the words that changed marked; empty when no step rewrote anything."""
        cell = "style='vertical-align:top;text-align:left;width:50%;color:#333'"
        rows = []
        for s in self.steps:
            for r in s.rewrites:
                before, after = marked(r["before"], r["after"])
                rows.append(f"<tr><th colspan=2 style='text-align:left'>{html.escape(s.name)}"
                            f"</th></tr><tr><td {cell}>{before}</td><td {cell}>{after}</td></tr>")
        if not rows:
            return ""
        return "<table><tr><th>before</th><th>after</th></tr>" + "".join(rows) + "</table>"


    def pairs_html(self) -> str:
        """Example near-duplicate pairs side by side (removed | kept) with their similarity and
        the words that differ marked; empty when no near-duplicate was removed."""
        cell = "style='vertical-align:top;text-align:left;width:50%;color:#333'"
        rows = []
        for s in self.steps:
            for e in s.examples:
                if "kept_row" not in e:
                    continue
                kept = e.get("kept_text")
                removed_html, kept_html = (marked(e["text"], kept) if kept else (
                    html.escape(e["text"]), "(not kept in memory: see that row of the input)"))
                rows.append(
                    f"<tr><th colspan=2 style='text-align:left'>row {e['row']} removed as a "
                    f"near-duplicate of row {e['kept_row']}: Jaccard {e['similarity']:.2f} "
                    f"({html.escape(e['method'])}); what differs is marked</th></tr>"
                    f"<tr><td {cell}>{removed_html}</td><td {cell}>{kept_html}</td></tr>")
        if not rows:
            return ""
        return ("<table><tr><th>removed</th><th>kept</th></tr>" + "".join(rows) + "</table>")


def _snippet(text: str, n: int = 300) -> str:
    return text[:n] + ("…" if len(text) > n else "")


def _jsonable(value: Any) -> Any:
    """Parameters as JSON values (dict keys become strings, tuples lists)."""
    return json.loads(json.dumps(value, default=str))
