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

from workbench.runs.registry import Registry, RunRecord
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


def _trained_run(wb_home: Path, name: str, spec: dict) -> Path:
    """A finished run's folder as training leaves it: spec.yaml beside an adapter of a hub base."""
    import yaml

    run_dir = wb_home / "runs" / f"{name}-20260101-000000-{secrets.token_hex(2)}"
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "base_model_name_or_path": "acme/chat-7b"}))
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (run_dir / "spec.yaml").write_text(yaml.safe_dump({"name": name, **spec}))
    return run_dir / "adapter"


def test_the_server_loads_the_base_revision_and_code_the_run_trained_with(wb_home, tmp_path):
    from workbench.serve.server import vllm_command

    adapter = _trained_run(wb_home, "pinned", {
        "model": {"id": "acme/chat-7b", "revision": "3f2a9c1", "trust_remote_code": True},
        "method": {"kind": "qlora"}, "resources": {"gpus_per_node": 2, "gpu_type": "A100-80G"}})
    plan = plan_serving([adapter])
    cmd = vllm_command("python", plan, "127.0.0.1", 8000, 256, 8, on_cpu=False, workdir=tmp_path)
    assert cmd[cmd.index("--revision") + 1] == "3f2a9c1"
    assert "--trust-remote-code" in cmd
    assert plan.gpus == 2
    assert any("QLoRA" in n and "unquantised" in n for n in plan.notes)
    # An adapter folder from elsewhere (no spec beside it) pins nothing and notes nothing.
    loose = tmp_path / "downloaded-adapter"
    loose.mkdir()
    (loose / "adapter_config.json").write_text(json.dumps({"r": 8,
                                                           "base_model_name_or_path": "acme/chat-7b"}))
    (loose / "adapter_model.safetensors").write_bytes(b"weights")
    plain = plan_serving([loose])
    cmd = vllm_command("python", plain, "127.0.0.1", 8000, 256, 8, on_cpu=False, workdir=tmp_path)
    assert "--revision" not in cmd and "--trust-remote-code" not in cmd and not plain.notes


def test_runs_on_two_revisions_of_a_base_cannot_share_a_server(wb_home):
    from workbench.errors import DeployError

    a = _trained_run(wb_home, "rev-a", {"model": {"id": "acme/chat-7b", "revision": "aaa111"}})
    b = _trained_run(wb_home, "rev-b", {"model": {"id": "acme/chat-7b", "revision": "bbb222"}})
    with pytest.raises(DeployError, match="different revisions"):
        plan_serving([a, b])


def test_a_slurm_endpoint_of_a_gpu_run_asks_for_a_gpu_even_if_the_target_defaults_to_cpu():
    from workbench.serve.slurm import SlurmServeTarget
    from workbench.targets.named import SlurmTarget

    cpu_default = SlurmServeTarget(SlurmTarget(name="c", partition="p"))
    assert cpu_default.gpus(0) == 0
    assert cpu_default.gpus(2) == 1  # one vLLM process, one card
    gpu_default = SlurmServeTarget(SlurmTarget(name="g", partition="p",
                                               defaults={"resources.gpus_per_node": 1}))
    assert gpu_default.gpus(0) == 1


def test_an_adapter_folder_with_its_config_but_no_weights_is_refused_up_front(wb_home, tiny_model):
    # What a copy cut short leaves: adapter_config.json arrived, adapter_model.safetensors did
    # not. Deploying it used to pass planning and fail inside vLLM (or peft) with an error naming
    # neither the folder nor the fix; chatting with it failed inside peft.
    from workbench.serve import merge
    from workbench.serve.infer import load_chat_model

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


def test_the_deploy_progress_line_has_no_colour_codes_or_log_prefix(tmp_path) -> None:
    from workbench.serve.server import _last_log_line

    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=7) \x1b[32mINFO\x1b[0m 12-04 16:38:48 [api_server.py:1] "
                   "Starting vLLM API server 0 on http://127.0.0.1:8000\n"
                   "(APIServer pid=7) \x1b[1;36mINFO\x1b[0m 12-04 16:38:49 [loader.py:2] "
                   "\x1b[1mLoading weights took 0.12 seconds\x1b[0m\n\n")
    assert _last_log_line(log) == "Loading weights took 0.12 seconds"
