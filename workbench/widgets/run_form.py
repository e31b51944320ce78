"""RunForm: pick a model, a dataset (with a preview), a method and the key knobs; launch.

The form holds a :class:`~workbench.spec.RunSpec` and nothing else: ``form.spec`` is what would be
launched, and the Launch button calls :func:`workbench.launch` like every other front end. A widget
shows its field as well as it can (a slider snaps to its grid and stops at its ends); the spec
takes a widget's value only once it was changed (by the user, or by a picked target's defaults),
so every field nobody touched stays exactly as it was given.
"""

from __future__ import annotations

import html
from typing import Any, get_args

import ipywidgets as W

from workbench.assets.teaching_images import BUILTIN_IMAGE_DATASET
from workbench.assets.tiny_vlm import BUILTIN_VLM
from workbench.errors import SpecError, WorkbenchError
from workbench.spec import RunSpec
from workbench.spec.sections import BUILTIN_DATASET, BUILTIN_MODEL, DataSource

_STYLE = {"description_width": "110px"}
_WIDE = W.Layout(width="460px")


def _preview_html(rows: list[dict[str, Any]]) -> str:
    out = ["<table style='font-size:12px'><tr><th>prompt</th><th>response</th></tr>"]
    for ex in rows:
        if "text" in ex:
            prompt, reply = ex["text"][:120], ""
        else:
            users = [m["content"] for m in ex["messages"] if m["role"] == "user"]
            bots = [m["content"] for m in ex["messages"] if m["role"] == "assistant"]
            prompt, reply = (users[0] if users else "")[:120], (bots[0] if bots else "")[:120]
        out.append(f"<tr><td style='text-align:left'>{html.escape(prompt)}</td>"
                   f"<td style='text-align:left'>{html.escape(reply)}</td></tr>")
    return "".join(out) + "</table>"


def length_figure(stats: Any, split: str = "train") -> Any:
    """Example lengths (tokens, before truncation) against max_length: a plotly FigureWidget when
    plotly is installed, else a matplotlib Figure."""
    hist = stats.histogram(split)
    edges, counts, limit = hist["edges"], hist["counts"], stats.max_length
    title = (f"{split}: token lengths vs max_length {limit} "
             f"({stats.splits[split].truncated} truncated, {stats.splits[split].dropped} dropped)")
    try:
        import plotly.graph_objects as go
    except ImportError:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5.2, 2.2), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", color="#1f77b4")
        ax.axvline(limit, color="#d62728", linestyle="--", label="max_length")
        ax.set_xlabel("tokens per example")
        ax.set_ylabel("examples")
        ax.set_title(title, fontsize=8)
        return fig
    fig = go.FigureWidget(go.Bar(x=edges[:-1], y=counts, width=edges[1] - edges[0], offset=0))
    fig.add_vline(x=limit, line_dash="dash", line_color="#d62728")
    fig.update_layout(title=title, height=240, width=520, xaxis_title="tokens per example")
    return fig


def _gpu_names() -> list[tuple[str, str | None]]:
    from workbench.targets.gpus import gpu_table

    return [("this machine", None)] + [(name, name) for name in gpu_table() if name != "CPU"]


def _put(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[a][b]...`` for ``"a.b..."``; a number is a list index."""
    *parents, leaf = dotted.split(".")
    node: Any = data
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[int(leaf) if leaf.isdigit() else leaf] = value


def _columns_text(columns: dict[str, str] | None) -> str:
    return ", ".join(f"{part}={column}" for part, column in (columns or {}).items())


def _parse_columns(text: str) -> dict[str, str] | None:
    """``"prompt=question, response=answer"`` as a source's ``columns``; None when empty."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        part, eq, column = item.partition("=")
        if not eq or not part.strip() or not column.strip():
            raise SpecError([("data.sources.0.columns",
                              f"{item!r}: write PART=COLUMN, e.g. prompt=question")])
        out[part.strip()] = column.strip()
    return out or None


class RunForm(W.VBox):
    """``RunForm(spec)`` shows ``spec``'s choices; ``form.spec`` reads them back as a RunSpec."""

    def __init__(self, spec: RunSpec | None = None, targets: list[str] | None = None) -> None:
        spec = spec or RunSpec()
        self._base = spec
        self.job: Any = None
        self.name = W.Text(spec.name, description="Run name", style=_STYLE, layout=_WIDE)
        self.model = W.Combobox(value=spec.model.id, options=[BUILTIN_MODEL, BUILTIN_VLM],
                                description="Model", style=_STYLE, layout=_WIDE,
                                placeholder="builtin:tiny-llama, a folder, or ORG/NAME")
        src = spec.data.sources[0]
        self.dataset = W.Combobox(value=src.path, options=[BUILTIN_DATASET, BUILTIN_IMAGE_DATASET],
                                  description="Dataset", style=_STYLE, layout=_WIDE,
                                  placeholder="jsonl / csv / parquet path, or ORG/NAME")
        self.format = W.Dropdown(options=list(get_args(DataSource.model_fields["format"].annotation)),
                                 value=src.format, description="Format", style=_STYLE)
        self.columns = W.Text(_columns_text(src.columns), description="Columns", style=_STYLE,
                              layout=_WIDE, placeholder="prompt=question, response=answer")
        self.use_columns = W.Button(description="Use these columns", icon="check",
                                    layout=W.Layout(display="none"))
        self.use_columns.on_click(lambda _b: self._take_suggestion())
        self._suggested = ""
        self.preview = W.HTML()
        self.lengths = W.Output(layout=W.Layout(width="540px"))
        self.method = W.ToggleButtons(options=["lora", "qlora", "full"], value=spec.method.kind,
                                      description="Method", style=_STYLE)
        self.lora_r = W.IntSlider(spec.method.lora_r, min=1, max=128, description="LoRA rank",
                                  style=_STYLE)
        self.lr = W.FloatLogSlider(spec.train.lr, base=10, min=-6, max=-1, step=0.1,
                                   readout_format=".1e", description="Learning rate", style=_STYLE)
        self.epochs = W.BoundedFloatText(spec.train.epochs, min=0.01, max=1000, step=1,
                                         description="Epochs", style=_STYLE)
        self.batch = W.IntSlider(spec.train.batch_size, min=1, max=128, description="Batch/proc",
                                 style=_STYLE)
        self.gpus = W.IntSlider(spec.resources.gpus_per_node, min=0, max=8,
                                description="GPUs/node", style=_STYLE)
        self.procs = W.IntSlider(spec.resources.procs_per_node, min=1, max=16,
                                 description="Processes", style=_STYLE)
        from workbench.targets.named import target_names  # local + targets.yaml (ssh:, slurm:)

        self.target = W.Dropdown(options=targets or target_names(spec.target), value=spec.target,
                                 description="Target", style=_STYLE)
        gpu_names = _gpu_names()
        if spec.resources.gpu_type not in [value for _label, value in gpu_names]:
            gpu_names.append((str(spec.resources.gpu_type), spec.resources.gpu_type))
        self.gpu_type = W.Dropdown(options=gpu_names, value=spec.resources.gpu_type,
                                   description="GPU type", style=_STYLE)
        self.plan_text = W.HTML()
        self.plan_plot = W.Image(format="png", layout=W.Layout(width="520px"))
        self.force = W.Checkbox(False, description="launch even if the plan does not fit",
                                indent=False)
        self.message = W.HTML()
        self.launch_button = W.Button(description="Launch", icon="play", button_style="primary")
        self.launch_button.on_click(lambda _b: self.launch())
        self.output = W.Output()
        # Each widget and the spec field it shows; what it showed first tells whether it changed.
        self._fields: dict[str, Any] = {
            "name": self.name, "model.id": self.model, "data.sources.0.path": self.dataset,
            "data.sources.0.format": self.format, "method.kind": self.method,
            "method.lora_r": self.lora_r, "train.lr": self.lr, "train.epochs": self.epochs,
            "train.batch_size": self.batch, "resources.gpus_per_node": self.gpus,
            "resources.processes_per_node": self.procs, "resources.gpu_type": self.gpu_type,
            "target": self.target}
        self._shown = {path: w.value for path, w in self._fields.items()}
        self._shown_columns = self.columns.value
        self.dataset.observe(lambda _c: self.update_preview(), names="value")
        self.columns.observe(lambda _c: self.update_preview(), names="value")
        self.format.observe(lambda _c: self.update_preview(), names="value")
        self.model.observe(lambda _c: self.update_preview(), names="value")  # text or images
        for w in (self.model, self.method, self.lora_r, self.lr, self.epochs, self.batch,
                  self.gpus, self.procs, self.target, self.name, self.gpu_type, self.columns):
            w.observe(lambda _c: self.validate(), names="value")
        self.gpus.observe(self._gpus_changed, names="value")
        self.target.observe(self._target_changed, names="value")
        super().__init__([
            W.HTML("<b>Fine-tuning run</b>"), self.name, self.model, self.dataset, self.format,
            self.columns, W.HBox([self.preview, self.use_columns]), self.lengths, self.method,
            self.lora_r, self.lr, self.epochs, self.batch, self.gpus, self.procs, self.gpu_type,
            self.target, W.HTML("<b>Plan</b>"), self.plan_text, self.plan_plot, self.force,
            self.message, self.launch_button, self.output,
        ])
        self.update_preview()
        self.validate()

    def _gpus_changed(self, change: dict[str, Any]) -> None:
        if change["new"] > 0:
            self.procs.value = change["new"]

    def _target_changed(self, change: dict[str, Any]) -> None:
        """Show a target's defaults (targets.yaml) in the form when it is picked."""
        from workbench.targets.named import TargetError, get_target

        if change["new"] == "local":
            return
        try:
            defaults = dict(get_target(change["new"]).defaults)
        except TargetError:
            return  # validate() and launch say what is wrong with the target
        # The defaults go into the spec as they are; a widget showing one shows it as well as it
        # can (a slider snaps to its grid) and counts as unchanged, so the spec keeps the default.
        self._base = self._base.updated(**defaults)
        for key in [k for k in defaults if k in self._fields]:
            self._fields[key].value = defaults[key]
            self._shown[key] = self._fields[key].value

    @property
    def spec(self) -> RunSpec:
        """The RunSpec the form describes (raises SpecError if a choice is invalid)."""
        data = self._base.model_dump(mode="json")
        changed = {path: w.value for path, w in self._fields.items()
                   if w.value != self._shown[path]}
        for path, value in changed.items():
            _put(data, path, value)
        if self.columns.value != self._shown_columns:
            data["data"]["sources"][0]["columns"] = _parse_columns(self.columns.value)
        if changed.get("method.kind", "qlora") != "qlora":
            data["model"]["quantization"] = "none"
        return RunSpec.parse(data)

    def validate(self) -> RunSpec | None:
        try:
            spec = self.spec
        except WorkbenchError as exc:
            self.message.value = f"<pre style='color:#d62728'>{html.escape(str(exc))}</pre>"
            self.launch_button.disabled = True
            return None
        self.message.value = ""
        self.launch_button.disabled = False
        self.update_plan(spec)
        return spec

    def update_plan(self, spec: RunSpec) -> Any:
        """Show the planner's verdict for the current choices (memory bars, time, cost)."""
        from workbench.plan import plan
        from workbench.widgets.plots import figure_png

        try:
            result = plan(spec)
        except WorkbenchError as exc:
            self.plan_text.value = f"<span style='color:#d62728'>{html.escape(str(exc))}</span>"
            self.plan_plot.value = b""
            return None
        self.plan_text.value = f"<pre style='font-size:11px'>{html.escape(result.summary())}</pre>"
        self.plan_plot.value = figure_png(result.plot())
        return result

    def update_preview(self) -> None:
        from workbench.data.prepare import preview_rows

        self.use_columns.layout.display = "none"
        try:
            if self._reads_images():
                self.preview.value = self._image_preview(3)
            else:
                self.preview.value = _preview_html(preview_rows(self._source(), 3))
        except WorkbenchError as exc:
            self.preview.value = f"<span style='color:#d62728'>{html.escape(str(exc))}</span>"
            self._offer_columns()
            return
        self.update_lengths()

    def _reads_images(self) -> bool:
        """Is the model picked one that reads images (asked of a folder here, never the hub)?"""
        from workbench.spec.models import is_vision_model

        try:
            return is_vision_model(self.model.value, local_only=True)
        except (WorkbenchError, OSError, ValueError):  # not found here: validate() says so
            return False

    def _image_preview(self, n: int) -> str:
        """The first ``n`` image rows, pictures as thumbnails beside their text."""
        from workbench.data.vision import image_examples
        from workbench.errors import EmptyDatasetError
        from workbench.widgets.image_preview import image_rows_html

        source = self._source()
        rows = [ex for _where, ex in image_examples(source.model_copy(update={"max_rows": n}))]
        if not rows:
            raise EmptyDatasetError(f"dataset {source.path!r} has no rows; give a non-empty file")
        return image_rows_html(rows)

    def _source(self) -> DataSource:
        """The first data source as the form shows it (the rest of the spec may be invalid)."""
        columns = (_parse_columns(self.columns.value) if self.columns.value != self._shown_columns
                   else self._base.data.sources[0].columns)
        return DataSource.model_validate({**self._base.data.sources[0].model_dump(),
                                          "path": self.dataset.value, "format": self.format.value,
                                          "columns": columns})

    def _offer_columns(self) -> None:
        """Where the file's first row has columns that look like a prompt and a response, offer
        them as the mapping (one click fills Columns)."""
        from workbench.data.formats import suggest_columns
        from workbench.data.sources import read_rows

        try:
            source = DataSource(path=self.dataset.value, format=self.format.value)
            _where, row = next(iter(read_rows(source)))
        except (WorkbenchError, StopIteration, OSError):
            return
        guess = suggest_columns(row)
        if guess and _columns_text(guess) != self.columns.value:
            self._suggested = _columns_text(guess)
            self.use_columns.description = f"Use columns: {self._suggested}"
            self.use_columns.layout.display = None

    def _take_suggestion(self) -> None:
        self.columns.value = self._suggested

    def update_lengths(self, sample: int = 500) -> Any:
        """Token statistics of the first ``sample`` rows, with a length histogram."""
        from workbench.data.tokenized import token_stats

        self.lengths.clear_output()
        try:
            if self._reads_images():  # image tokens as the model's processor makes them
                from workbench.data.vision import spec_processor, vision_token_stats
                from workbench.spec.models import resolve_model

                spec = self.spec
                stats = vision_token_stats(spec, spec_processor(spec, resolve_model(spec.model.id)),
                                           max_rows=sample)
            else:
                stats = token_stats(self.spec, max_rows=sample)
        except (WorkbenchError, OSError, ValueError) as exc:  # e.g. a tokenizer out of reach
            self.lengths.append_stdout(f"token statistics unavailable: {exc}\n")
            return None
        # append_* rather than `with output:` so the chart shows whether or not a kernel runs.
        self.lengths.append_stdout(f"first {sample} rows: {stats.summary()}\n")
        fig = length_figure(stats)
        if hasattr(fig, "savefig"):  # matplotlib: a PNG shows in every front end
            from workbench.widgets.plots import figure_png

            fig = W.Image(value=figure_png(fig), format="png")
        self.lengths.append_display_data(fig)
        return stats

    def launch(self, force: bool = False) -> Any:
        from workbench.runs.launching import launch

        spec = self.validate()
        if spec is None:
            return None
        self.launch_button.disabled = True
        self.message.value = "<i>preparing data and starting…</i>"
        try:
            self.job = launch(spec, force=force or self.force.value)
        except WorkbenchError as exc:
            self.message.value = f"<pre style='color:#d62728'>{html.escape(str(exc))}</pre>"
            return None
        finally:
            self.launch_button.disabled = False
        self.message.value = f"launched <code>{html.escape(self.job.id)}</code>"
        self.output.clear_output()
        with self.output:
            from IPython.display import display

            display(self.job.show())
        return self.job
