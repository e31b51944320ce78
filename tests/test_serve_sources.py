"""What to serve when ``deploy`` is given a run's id or name (workbench/serve/sources.py).

No vLLM and no training: the runs are run directories written by hand (an adapter's two JSON
files, a status.json) and registered in the session's registry, as a finished run leaves them.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
import torch

from workbench.registry import Registry, RunRecord
from workbench.serve import AdapterNotFoundError, plan_serving


def _run(wb_home: Path, name: str, state_on_disk: str, state_in_registry: str,
         adapter: bool, weights: bool = True) -> RunRecord:
    run_id = f"20260101-000000-{secrets.token_hex(3)}"
    run_dir = wb_home / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": state_on_disk}))
    if adapter:
        (run_dir / "adapter").mkdir()
        (run_dir / "adapter" / "adapter_config.json").write_text(json.dumps(
            {"r": 4, "base_model_name_or_path": "builtin:tiny-llama"}))
        (run_dir / "adapter" / "workbench.json").write_text(json.dumps(
            {"base_model": "builtin:tiny-llama"}))
        (run_dir / "adapter" / "chat_template.jinja").write_text("{{ messages }}")
        if weights:  # a real safetensors file, as peft writes one (the values do not matter here)
            from safetensors.torch import save_file

            save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8)},
                      str(run_dir / "adapter" / "adapter_model.safetensors"))
    now = time.time()
    record = RunRecord(id=run_id, name=name, target="local", backend_job_id=None,
                       run_dir=str(run_dir), state=state_in_registry, created=now, updated=now)
    return Registry().add_run(record)


def test_a_run_is_found_by_id_and_by_name(wb_home, tiny_model):
    run = _run(wb_home, f"named-{secrets.token_hex(2)}", "succeeded", "succeeded", adapter=True)
    by_name, by_id = plan_serving([run.name]), plan_serving([run.id])
    assert by_name == by_id
    [adapter] = by_name.adapters
    # Served under the run's name, from its adapter folder, on the base it was trained on.
    assert (adapter.name, adapter.path, adapter.rank, adapter.run_id) == (
        run.name, Path(run.run_dir) / "adapter", 4, run.id)
    assert Path(adapter.base) == tiny_model and by_name.model == adapter.base
    assert by_name.run_ids == [run.id] and by_name.chat_template == "{{ messages }}"


def test_a_run_without_weights_says_its_state_as_its_run_directory_has_it(wb_home):
    # The registry's copy lags behind (a run that failed while nobody watched): the message must
    # give the state the run directory holds, as Job.state does.
    run = _run(wb_home, f"broken-{secrets.token_hex(2)}", "failed", "running", adapter=False)
    with pytest.raises(AdapterNotFoundError,
                       match=rf"run {run.id} has no adapter/ or model/ folder \(state failed\)"):
        plan_serving([run.name])


def test_an_unknown_run_name_says_how_to_list_the_runs():
    with pytest.raises(AdapterNotFoundError, match="neither a run.*`workbench status` lists"):
        plan_serving(["no-run-has-this-name"])


def test_an_adapter_folder_with_its_config_but_no_weights_is_refused_up_front(wb_home, tiny_model):
    # What a copy cut short leaves: adapter_config.json arrived, adapter_model.safetensors did
    # not. Deploying it used to pass planning and fail inside vLLM (or peft) with an error naming
    # neither the folder nor the fix; chatting with it failed inside peft.
    from workbench.infer import load_chat_model
    from workbench.serve import merge

    run = _run(wb_home, f"cut-{secrets.token_hex(2)}", "succeeded", "succeeded", adapter=True,
               weights=False)
    folder = Path(run.run_dir) / "adapter"
    for source in (run.name, str(folder)):
        with pytest.raises(AdapterNotFoundError, match=r"no adapter weights.*copy the folder "
                                                       r"again, or resume the run") as info:
            plan_serving([source])
        assert str(folder) in str(info.value)
    for entry in (merge, load_chat_model):
        with pytest.raises(AdapterNotFoundError, match="no adapter weights"):
            entry(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == [  # nothing written, nothing removed
        "adapter_config.json", "chat_template.jinja", "workbench.json"]
