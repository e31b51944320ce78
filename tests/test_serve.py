"""Serving with real vLLM on CPU: a run trained here is deployed and compared with transformers.

Two servers are shared by every test (started together, so their start-ups overlap): the run's
adapter on its base model (bound beyond loopback, so it requires an API key) and the run's merged
weights (loopback). Bad inputs must fail before anything starts, and leave no process behind.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import workbench
from tests.waiting import alive, wait_for
from workbench.assets.teaching import score, teaching_rows
from workbench.serve import (
    AdapterNotFoundError,
    EndpointStartError,
    LoraRankError,
    PortInUseError,
    ServingEnvironmentError,
    UnsupportedModelError,
    deploy,
    endpoints,
    get_endpoint,
    probe_serving_python,
    serving_python,
)
from workbench.serve.local import LocalServeTarget
from workbench.serve.server import guard_command

HELDOUT = [r["instruction"] for r in teaching_rows("heldout")]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="session")
def serve_python() -> str:
    python = serving_python()
    try:
        probe_serving_python(python)
    except ServingEnvironmentError as exc:  # `make test` builds it: its absence is a failure
        pytest.fail(f"no vLLM to serve with ({exc}); `make serve-env` installs it")
    return python


@pytest.fixture(scope="session")
def trained(served_run):
    return served_run  # tests/conftest.py: shared with the remote serving tests


@pytest.fixture(scope="session")
def servers(trained, serve_python):
    """(adapter endpoint on 0.0.0.0 with an API key, merged-weights endpoint on loopback)."""
    started = []
    try:
        adapter = deploy(trained, host="0.0.0.0", wait=False, progress=False)
        started.append(adapter)
        merged = trained.deploy(name="serve-test-merged", merge=True, wait=False, progress=False)
        started.append(merged)
        adapter.wait_healthy(timeout=400, progress=False)
        merged.wait_healthy(timeout=400, progress=False)
        yield adapter, merged
    finally:
        # Both stop at once: each stop waits for its own guard and server to exit.
        with ThreadPoolExecutor(max(1, len(started))) as pool:
            ended = list(pool.map(_stopped, started))
        for ep, pids in ended:
            assert not any(alive(p) for p in pids), f"{ep.name} left processes {pids}"
            assert get_endpoint(ep.name).record.state == "stopped"


def _stopped(ep):
    """``ep`` stopped, and the (guard, server) PIDs it had."""
    pids = (ep.record.pid, ep.record.server_pid)
    ep.stop()
    return ep, pids


@pytest.fixture(scope="session")
def reference(trained):
    """transformers + peft greedy replies of the adapter (ChatModel.generate, batched)."""
    from workbench.serve.infer import load_chat_model

    return {"adapter": load_chat_model(trained).generate(HELDOUT)}


def test_adapter_output_equals_transformers_peft_token_for_token(servers, reference):
    adapter, _ = servers
    got = adapter.generate(HELDOUT, model="serve-test")
    assert got == reference["adapter"]


def _transformers_ids(source, prompts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new ids up to and including EOS) from transformers (+ peft)."""
    import torch

    from workbench.serve.infer import load_chat_model

    chat = load_chat_model(source)
    tok = chat.tokenizer
    tok.padding_side = "left"  # as ChatModel.generate batches
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        gen = chat.model.generate(**enc, max_new_tokens=16, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
    out = []
    width = enc["input_ids"].shape[1]
    for row, mask, new in zip(enc["input_ids"], enc["attention_mask"], gen[:, width:].tolist()):
        if tok.eos_token_id in new:  # after EOS a batch holds only padding
            new = new[: new.index(tok.eos_token_id) + 1]
        out.append((row[mask.bool()].tolist(), new))
    return out


def test_token_ids_equal_transformers_for_adapter_and_base(servers, trained):
    """Ids, not text: the base model's garbage ends mid-character, which text comparison hides."""
    adapter, _ = servers
    for model, source in (("serve-test", trained), ("tiny-llama", "builtin:tiny-llama")):
        assert adapter.generate_token_ids(HELDOUT, model=model) == _transformers_ids(source, HELDOUT)


def test_fine_tuned_adapter_answers_better_than_the_base(servers):
    adapter, _ = servers
    tuned = score(lambda qs: adapter.generate(qs, model="serve-test"))
    base = score(lambda qs: adapter.generate(qs, model="tiny-llama"))
    assert tuned["accuracy"] >= 0.5 and base["accuracy"] <= 0.1, (tuned["accuracy"], base["accuracy"])


def test_merged_weights_give_the_adapter_output(servers, reference):
    _, merged = servers
    assert merged.models == ["serve-test"]  # the run's name, as for its adapter
    assert merged.generate(HELDOUT) == reference["adapter"]
    assert merged.api_key is None  # loopback: no key


def test_endpoint_api_registry_and_cli(servers):
    import httpx

    from workbench.cli import run

    adapter, merged = servers
    assert adapter.models == ["tiny-llama", "serve-test"] and adapter.model == "serve-test"
    assert sorted(adapter.list_models()) == sorted(adapter.models)
    # Bound beyond loopback: a key was generated and requests without it are refused.
    assert adapter.api_key and len(adapter.api_key) >= 24
    no_key = httpx.post(adapter.api_base + "/chat/completions", json={
        "model": "serve-test", "messages": [{"role": "user", "content": "hi"}]})
    assert no_key.status_code == 401
    reply = adapter.chat("What does a cow say?")
    # The OpenAI client people already use, bound to the endpoint (URL and key).
    completion = adapter.client().chat.completions.create(
        model="serve-test", messages=[{"role": "user", "content": "What does a cow say?"}],
        temperature=0.0, max_tokens=64)
    assert completion.choices[0].message.content == reply
    assert "".join(adapter.chat("What does a cow say?", stream=True)) == reply
    # A raw completion of the chat template written out by hand is the same greedy answer as
    # the chat endpoint's (cut at its 4 tokens), so /completions serves the same adapter.
    raw = adapter.complete("<|bos|><|user|>\nOpposite of hot?<|end|>\n<|assistant|>\n",
                           max_tokens=4)
    answer = adapter.chat("Opposite of hot?", max_tokens=64)
    assert raw.strip() and answer.startswith(raw.strip()), (raw, answer)
    listed = {e.name: e for e in endpoints()}
    assert {"serve-test", "serve-test-merged"} <= set(listed)
    assert listed["serve-test"].record.state == "healthy"
    assert json.loads(listed["serve-test"].record.serves)["runs"] == [adapter.serves["runs"][0]]
    table = run(["endpoints"])
    assert "serve-test-merged" in table and merged.api_base in table
    assert adapter.logs(tail=None).strip()  # the server's own log is readable from here


def test_chat_widget_streams_a_conversation(servers):
    from workbench.widgets.chat import ChatWidget

    adapter, _ = servers
    widget = ChatWidget(adapter, max_tokens=8)
    first = widget.send("What does a cow say?")
    assert first and first in widget.conversation.value
    # One question at a time by default: the second answer is the answer to it alone (greedy).
    second = widget.send("What is the capital of France?")
    assert second == adapter.chat("What is the capital of France?", max_tokens=8)
    assert [m["role"] for m in widget.messages] == ["user", "assistant"]
    widget.multi_turn.value = True  # the whole conversation goes with each turn
    widget.send("And of Italy?")
    assert [m["role"] for m in widget.messages] == ["user", "assistant"] * 2
    widget.clear()
    assert widget.messages == [] and widget.conversation.value == ""


def test_a_chat_with_a_stopped_endpoint_says_it_stopped(wb_home):
    from workbench.runs.registry import EndpointRecord, Registry
    from workbench.serve.endpoint import get_endpoint
    from workbench.widgets.chat import ChatWidget

    with socket.socket() as s:  # a port nothing listens on any more
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    now = time.time()
    Registry().add_endpoint(EndpointRecord(
        name="gone", target="local", url=f"http://127.0.0.1:{port}", state="stopped", pid=None,
        server_pid=None, endpoint_dir=str(wb_home / "endpoints" / "gone"),
        serves=json.dumps({"models": ["m"]}), created=now, updated=now))
    widget = ChatWidget(get_endpoint("gone"), max_tokens=8)
    assert widget.send("hello?") == ""
    assert "endpoint gone is stopped, so nothing answers; deploy the run again" in \
        widget.status.value
    assert "Errno" not in widget.status.value


def test_evaluate_through_vllm_scores_as_transformers_and_judges(servers, trained, tmp_path):
    """workbench.evaluate on an endpoint: its greedy heldout answers are transformers + peft's,
    so the scores are the same, whether the prompts go in one batch request (vLLM's access log
    shows the one request) or one by one; the other server as a judge answers every comparison,
    in both orders, and each verdict is counted once (a tiny model's verdicts may well be
    nonsense)."""
    adapter, merged = servers
    qa = tmp_path / "qa.jsonl"
    rows = list(teaching_rows("heldout"))[:12]
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def posted(path: str) -> int:
        return adapter.logs(None).count(f'"POST {path} HTTP')

    batches, chats = posted("/v1/chat/completions/batch"), posted("/v1/chat/completions")
    served = workbench.evaluate(endpoint=adapter.name, tasks=["heldout"], file=qa,
                                max_new_tokens=24)
    wait_for(lambda: posted("/v1/chat/completions/batch") == batches + 1, 30,
             "the endpoint's log to show the one batch request")
    assert posted("/v1/chat/completions") == chats
    local = workbench.evaluate(trained.run_dir.adapter_dir, tasks=["heldout"], file=qa,
                               max_new_tokens=24)
    answers = [r["prediction"] for r in served.examples["heldout"]]
    assert answers == [r["prediction"] for r in local.examples["heldout"]]
    assert served.metrics == local.metrics
    # All 12 prompts in flight at once (vLLM batches them) give, example for example and in the
    # prompts' order, what one request at a time gives.
    one_by_one = workbench.evaluate(endpoint=adapter.name, tasks=["heldout"], file=qa,
                                    max_new_tokens=24, concurrency=1)
    assert one_by_one.examples["heldout"] == served.examples["heldout"]
    # Not two empty lists agreeing: the tuned adapter gets the teaching answers right.
    right = sum(a.strip().lower() == r["output"].lower() for a, r in zip(answers, rows))
    assert right >= 6 and served.metrics["heldout.exact_match"] == right / len(rows)
    assert served.lines[0]["model"] == f"endpoint:{adapter.name}"

    judged = workbench.evaluate(endpoint=adapter.name, file=qa, max_samples=4,
                                tasks=[{"kind": "judge", "judge": merged.name}])
    (line,) = judged.lines
    m, verdicts = line["metrics"], judged.examples["judge"]
    assert line["n"] == len(verdicts) == 4 and line["baseline"] == "reference"
    asked = [(v["verdict_evaluated_first"], v["verdict_evaluated_second"]) for v in verdicts]
    assert all(isinstance(a, str) and isinstance(b, str) for a, b in asked)
    assert m["wins"] + m["losses"] + m["ties"] + m["unparseable"] == 2 * 4
    assert ("win_rate" in m) == (m["unparseable"] < 8)


def test_second_adapter_on_the_same_base_and_rank_above_max(servers, trained, tmp_path):
    adapter, _ = servers
    name = adapter.add_adapter(trained.run_dir.adapter_dir, name="serve-test-copy")
    assert name in adapter.list_models()
    assert adapter.generate(HELDOUT[:8], model=name) == adapter.generate(HELDOUT[:8],
                                                                          model="serve-test")
    wide = _untrained_adapter(tmp_path / "r32", rank=32)
    with pytest.raises(LoraRankError, match="max_lora_rank 16.*max_lora_rank=32"):
        adapter.add_adapter(wide)


@pytest.mark.parametrize("run", ["dpo_job", "orpo_job", "kto_job", "grpo_job"])
def test_preference_adapters_serve_and_answer_as_transformers(servers, run, request):
    """A LoRA trained with each preference stage -- dpo (an implicit reference), orpo (none;
    killed and resumed), kto (under ZeRO-2; killed and resumed), grpo (sampled completions and
    rewards) -- is an ordinary adapter on the same base: added to the shared server, its greedy
    answers are transformers + peft's, token for token. The runs are the session's shared
    preference runs (tests/preference_runs.py), which test_preference_train.py also reads."""
    job = request.getfixturevalue(run)
    stage = job.spec.method.stage
    assert json.loads((job.run_dir.adapter_dir / "workbench.json").read_text())["stage"] == stage
    adapter, _ = servers
    name = adapter.add_adapter(job.run_dir.adapter_dir, name=f"serve-{stage}")
    assert name in adapter.list_models()
    # Ids, not text: a few steps from the base model still answer garbage that may end
    # mid-character (DPO), or an end-of-sequence at once (ORPO's training on short answers).
    served = adapter.generate_token_ids(HELDOUT[:8], model=name)
    assert served == _transformers_ids(job, HELDOUT[:8])
    # The adapter changed the answers: a server that ignored it would answer as the base.
    assert served != adapter.generate_token_ids(HELDOUT[:8], model="tiny-llama")


def _untrained_adapter(path: Path, rank: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = workbench.assets.builtin_model_path()
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=rank, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(path)
    (path / "workbench.json").write_text(json.dumps({"base_model": str(base)}))
    return path


# -- bad inputs: a typed error that says what to do, and nothing left running ----------------------
def _refused(error: type, match: str, *args, **kwargs) -> None:
    before = _children()
    with pytest.raises(error, match=match):
        deploy(*args, progress=False, **kwargs)
    # A refused start may still be reaping what it began: wait for that, generously.
    deadline = time.time() + 60
    while not _children() <= before and time.time() < deadline:
        time.sleep(0.2)
    assert _children() <= before, "a refused deploy left a process running"
    if "name" in kwargs:
        assert kwargs["name"] not in [e.name for e in endpoints()]


def test_missing_adapter_folder(tmp_path, serve_python):
    _refused(AdapterNotFoundError, "does not exist.*pass a run", tmp_path / "no-such-adapter")


def test_adapter_rank_above_the_servers_max(trained, serve_python):
    _refused(LoraRankError, "rank 16, above the server's max_lora_rank 8; deploy with "
             "max_lora_rank=16", trained, name="too-small", max_lora_rank=8)


def test_port_already_in_use(trained, serve_python):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _refused(PortInUseError, f"port {port} on 127.0.0.1 is already in use.*another port",
                 trained, name="taken", port=port)


def test_no_vllm_in_the_serving_environment(trained):
    _refused(ServingEnvironmentError, "has no vLLM installed.*make serve-env", trained,
             name="no-vllm", python=sys.executable)
    _refused(ServingEnvironmentError, "cannot run", trained, name="no-python",
             python="/nonexistent/bin/python")


def test_head_size_the_cpu_backend_cannot_serve(tmp_path, serve_python):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "head16"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4)).save_pretrained(folder)
    _refused(UnsupportedModelError, "head size 16; vLLM's CPU backend serves only 32, 64",
             folder, name="head16")


def test_an_image_model_is_refused_where_the_serving_python_has_no_torchvision(serve_python):
    """The CPU serving environment has no torchvision (`make serve-env` removes the CUDA-linked
    one), and vLLM cannot build a Qwen2-VL's processor without it: refused before any start."""
    from workbench.serve.checks import check_reads_images
    from workbench.spec.models import resolve_model

    has = subprocess.run([serve_python, "-c", "import importlib.util; print(importlib.util."
                          "find_spec('torchvision') is not None)"], capture_output=True, text=True)
    assert has.stdout.strip() == "False", has  # the environment this test is about
    _refused(UnsupportedModelError, "reads images.*torchvision.*install the torchvision build",
             "builtin:tiny-qwen2-vl", name="vlm", python=serve_python)
    # Where torchvision is there, the check lets it through (vLLM decides the rest).
    check_reads_images(resolve_model("builtin:tiny-qwen2-vl"), serve_python, {"torchvision": True})


def test_a_server_that_dies_while_starting_is_reported_and_cleaned_up(trained, serve_python):
    # vLLM itself rejects the flag, after its imports: the failure comes from a started server.
    with pytest.raises(EndpointStartError, match="(?s)exited during start-up.*--no-such-flag"):
        deploy(trained, name="broken", extra_args=["--no-such-flag"], progress=False, timeout=300)
    record = get_endpoint("broken").record
    assert record.state == "failed"
    assert not alive(record.pid) and not alive(record.server_pid)


def test_guard_stops_the_server_when_the_deploying_process_ends(tmp_path):
    """keep=False: a server does not outlive the kernel that started it (here: a stand-in)."""
    # The stand-in kernel lives until we close its stdin, not for a fixed time that a loaded
    # machine could outlast while the server starts.
    kernel = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    target = LocalServeTarget()
    command = guard_command(sys.executable, str(tmp_path), "127.0.0.1", 0,
                            f"--watch-pid {kernel.pid}", ["sleep", "120"])
    guard, server = target.start(command, {}, tmp_path, kernel.pid)
    record = SimpleNamespace(pid=guard, server_pid=server, endpoint_dir=str(tmp_path))
    assert alive(server) and target.alive(record)
    assert server == int((tmp_path / "server.pid").read_text())
    assert json.loads((tmp_path / "address.json").read_text())["port"] > 0  # --port 0: picked
    assert kernel.stdin is not None
    kernel.stdin.close()
    kernel.wait(timeout=60)
    deadline = time.time() + 60
    while alive(server) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(server)
    # The guard records how the server ended just after it is gone: wait for that file.
    while not (tmp_path / "exit.json").is_file() and time.time() < deadline:
        time.sleep(0.2)
    ended = json.loads((tmp_path / "exit.json").read_text())
    assert ended["reason"] == "watched process ended"
