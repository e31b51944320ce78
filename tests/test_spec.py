"""RunSpec: defaults, YAML round-trip, and an error that names the field for every bad input."""

from __future__ import annotations

import pytest

from workbench.errors import SpecError
from workbench.spec import RunSpec


def test_defaults_are_the_builtin_quickstart():
    spec = RunSpec()
    assert spec.model.id == "builtin:tiny-llama"
    assert spec.data.sources[0].path == "builtin:teaching"
    assert spec.target == "local"
    assert spec.resources.procs_per_node == 2  # CPU default: two processes
    assert spec.resources.world_size == 2


def test_yaml_round_trip_text_and_file(tmp_path):
    spec = RunSpec(name="r1", method={"kind": "full"}, train={"max_steps": 7, "lr": 1e-3},
                   resources={"gpus_per_node": 4}, data={"sources": [{"path": "a.jsonl"},
                                                                     {"path": "b.csv"}]})
    assert RunSpec.from_yaml(spec.to_yaml()) == spec
    path = spec.save(tmp_path / "spec.yaml")
    again = RunSpec.from_yaml(path)
    assert again == spec
    assert again.resources.procs_per_node == 4  # one process per GPU


@pytest.mark.parametrize(
    ("yaml_text", "path", "fragment"),
    [
        ("train: {learning_rate: 0.1}", "train.learning_rate", "did you mean 'lr'"),
        ("trian: {lr: 0.1}", "trian", "did you mean 'train'"),
        ("data: {sources: [{pth: x.jsonl}]}", "data.sources.0.pth", "did you mean 'path'"),
        ("train: {lr: -1}", "train.lr", "greater than 0"),
        ("method: {kind: lorra}", "method.kind", "'lora', 'qlora' or 'full'"),
        ("target: ftp://x", "target", "'ssh:NAME'"),
        ("name: 'has space'", "name", "letters, digits"),
        ("data: {sources: []}", "data.sources", "at least 1"),
        ("model: {quantization: 4bit}", "", "method.kind: qlora"),
    ],
)
def test_bad_specs_name_the_field_and_the_fix(yaml_text, path, fragment):
    import yaml

    # The YAML path, and RunSpec(**mapping) in a notebook: the same SpecError, no pydantic text.
    for make in (lambda: RunSpec.from_yaml(yaml_text), lambda: RunSpec(**yaml.safe_load(yaml_text))):
        with pytest.raises(SpecError) as info:
            make()
        problems = dict(info.value.problems)
        assert path in problems, info.value.problems
        assert fragment in str(info.value) and "pydantic" not in str(info.value)


def test_not_a_mapping_and_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="expected a mapping"):
        RunSpec.from_yaml("- 1\n- 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        RunSpec.from_yaml("train: {lr: [\n")
    with pytest.raises(SpecError, match="does not exist"):
        RunSpec.from_yaml(tmp_path / "nope.yaml")


def test_plan_and_launch_take_every_spec_form_and_refuse_others(tmp_path):
    import workbench

    mapping = {"train": {"max_steps": 7}}
    (tmp_path / "run.yaml").write_text("train:\n  max_steps: 7\n")
    forms = [mapping, RunSpec.parse(mapping), tmp_path / "run.yaml", str(tmp_path / "run.yaml")]
    assert all(RunSpec.coerce(f) == RunSpec.parse(mapping) for f in forms)
    assert RunSpec.coerce(None) == RunSpec()
    # plan() took only a RunSpec and failed on a mapping with an AttributeError.
    assert workbench.plan(mapping).steps == workbench.plan(RunSpec.parse(mapping)).steps == 7
    for entry in (workbench.plan, workbench.launch):
        with pytest.raises(SpecError, match="expected a RunSpec, a mapping or a YAML path, got int"):
            entry(42)


def test_qlora_implies_4bit_and_updated_applies_dotted_paths():
    spec = RunSpec(method={"kind": "qlora"})
    assert spec.model.quantization == "4bit"
    changed = RunSpec().updated(**{"train.lr": 0.01, "resources.gpus_per_node": 2})
    assert changed.train.lr == 0.01 and changed.resources.gpus_per_node == 2
    with pytest.raises(SpecError, match="train.lr"):
        RunSpec().updated(**{"train.lr": 0})


def _leaves(model, prefix=""):
    """Every field path of a pydantic model, [] for an item of a list, as KNOBS names them."""
    import typing

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        ann = field.annotation
        inner = [a for a in (ann, *typing.get_args(ann)) if isinstance(a, type)
                 and issubclass(a, BaseModel)]
        listed = [a for a in typing.get_args(ann) if typing.get_origin(a) is list] or \
            ([ann] if typing.get_origin(ann) is list else [])
        if listed:
            item = typing.get_args(listed[0])[0]
            if isinstance(item, type) and issubclass(item, BaseModel):
                yield from _leaves(item, f"{prefix}{name}[].")
                continue
        if inner and not listed:
            yield from _leaves(inner[0], f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}"


def test_every_knob_has_a_line_and_the_commented_yaml_loads_back(tmp_path):
    from workbench.cli import run
    from workbench.spec.knobs import KNOBS

    fields = set(_leaves(RunSpec))
    assert set(KNOBS) - fields == {"data.sources", "method.rewards", "eval.tasks"}  # the lists
    assert not fields - set(KNOBS), sorted(fields - set(KNOBS))
    assert len(fields) > 80  # the walk found the nested sections and lists
    run(["spec", "-o", str(tmp_path / "s.yaml")])
    text = (tmp_path / "s.yaml").read_text()
    assert RunSpec.from_yaml(tmp_path / "s.yaml") == RunSpec()
    assert "  lr: 0.0002  # peak learning rate" in text.splitlines()
    bare = [ln for ln in text.splitlines() if ":" in ln and not ln.rstrip().endswith(":")
            and "#" not in ln]
    assert not bare, bare  # every value has its comment
