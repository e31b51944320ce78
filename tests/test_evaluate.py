"""Scorers (workbench.evaluate) against hand computations, a real HTTP judge and real lm-eval.

No training here (tests/test_evaluate_run.py trains); the model is the built-in tiny one.
"""

from __future__ import annotations

import json
import math

import pytest

import workbench
from tests.evaluate_support import JudgeServer, write_sounds_task
from workbench.errors import EvalError, EvalTaskError, JudgeError, SpecError
from workbench.evaluate import heldout, judge
from workbench.evaluate.sources import EndpointSource
from workbench.spec import RunSpec


@pytest.fixture(scope="module")
def judge_server():
    server = JudgeServer()
    yield server
    server.close()


def test_eval_section_round_trips_and_names_bad_fields():
    spec = RunSpec.parse({"eval": {"before": True, "every_steps": 5,
                                   "tasks": ["heldout", {"kind": "lm_eval", "tasks": ["x.yaml"]}]}})
    assert [t.kind for t in spec.eval.tasks] == ["heldout", "lm_eval"]
    assert RunSpec.from_yaml(spec.to_yaml()) == spec
    assert RunSpec().eval.after and [t.kind for t in RunSpec().eval.tasks] == ["heldout"]
    with pytest.raises(SpecError, match=r"eval.tasks.0: a judge task needs judge"):
        RunSpec.parse({"eval": {"tasks": ["judge"]}})
    with pytest.raises(SpecError, match=r"eval.tasks.0.kind"):
        RunSpec.parse({"eval": {"tasks": ["bleu"]}})
    with pytest.raises(SpecError, match=r"eval.every_steps"):
        RunSpec.parse({"eval": {"every_steps": 0}})


def test_heldout_metrics_match_hand_computed_english():
    out = heldout.scores(["the cat sat", " MOO "], ["the cat sat on the mat", "moo"])
    assert out["exact_match"] == 0.5  # case and spaces do not count
    assert out["contains"] == 0.5  # the first answer is only part of its reference
    # ROUGE-L F1: LCS 3 of 3 predicted and 6 reference words -> 2*1*0.5/1.5; then 1.0
    assert out["rouge_l"] == pytest.approx((2 / 3 + 1.0) / 2)
    assert heldout.scores(["a b c d e"], ["a b c d e"])["chrf"] == pytest.approx(100.0)


def test_bleu_is_left_out_where_answers_are_too_short_to_have_4_grams():
    # One-word answers: BLEU is 0 even for the right answer (no 4-gram to match), while exact
    # match says 1/2; the two would contradict, so BLEU is not reported.
    short = heldout.scores(["moo", "meow"], ["moo", "bark"])
    assert short["exact_match"] == 0.5 and "bleu" not in short
    # Sentences of 4+ words: BLEU is reported (an exact copy scores 100).
    long = heldout.scores(["the cow says moo loudly"], ["the cow says moo loudly"])
    assert long["bleu"] == pytest.approx(100.0)


def test_heldout_metrics_match_hand_computed_chinese():
    # 9 characters each; the last two differ. Per character: 7/9 unigrams, 6/8 bigrams, 5/7
    # trigrams, 4/6 four-grams, equal lengths (no brevity penalty).
    pred, ref = "我今天很喜欢吃苹果", "我今天很喜欢吃香蕉"
    out = heldout.scores([pred], [ref])
    bleu = 100 * math.exp((math.log(7 / 9) + math.log(6 / 8) + math.log(5 / 7)
                           + math.log(4 / 6)) / 4)
    assert out["bleu"] == pytest.approx(bleu, rel=1e-6)
    assert out["rouge_l"] == pytest.approx(7 / 9)  # LCS 7 of 9 characters, both sides
    assert out["exact_match"] == 0.0 and 0 < out["chrf"] < 100


def test_perplexity_matches_a_hand_computation_with_torch(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = ["the cow says moo and the cat says meow", "a frog croaks"]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    report = workbench.evaluate(str(tiny_model), tasks=["perplexity"], file=tmp_path / "t.jsonl")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    nll, count = 0.0, 0
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"][0]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
        nll -= sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1))
        count += len(ids) - 1
    line = report.lines[0]
    assert line["task"] == "perplexity" and line["n"] == 2
    assert line["metrics"]["tokens"] == count
    assert line["metrics"]["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_judge_win_rate_is_position_swapped(judge_server):
    src = EndpointSource(judge_server.url)
    judge_server.mode = "fair"
    evaluated, baseline = ["good", "good", "bad", "good"], ["bad", "bad", "good", "good"]
    metrics, rows = judge.run(src, ["q1", "q2", "q3", "q4"], evaluated, baseline, rubric="R")
    # Win, win, loss, tie, each seen in both orders.
    assert metrics["win_rate"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert (metrics["wins"], metrics["losses"], metrics["ties"]) == (4, 2, 2)
    assert metrics["consistency"] == 1.0 and metrics["unparseable"] == 0
    assert all("R" in p for p in judge_server.requests[-8:])  # the rubric reaches the judge
    # A judge that always prefers the first answer cancels out to a tie on every prompt.
    judge_server.mode = "first"
    metrics, _ = judge.run(src, ["q1", "q2"], ["good", "bad"], ["bad", "good"], rubric="R")
    assert metrics["win_rate"] == 0.5 and metrics["consistency"] == 0.0


def test_judge_nonsense_is_counted_not_fatal(judge_server):
    judge_server.mode = "nonsense"
    metrics, rows = judge.run(EndpointSource(judge_server.url), ["q1", "q2"], ["a", "b"],
                              ["c", "d"], rubric="R")
    assert metrics["unparseable"] == 4 and "win_rate" not in metrics
    assert [r["score"] for r in rows] == [None, None]
    judge_server.mode = "fair"


def test_endpoint_answers_in_prompt_order_and_stops_at_the_first_refusal(judge_server):
    cow = [{"role": "user", "content": "What does a cow say?"}]
    other = [{"role": "user", "content": "What is two plus two?"}]
    prompts = [cow, other, other, cow, other, cow, cow, other, other]
    judge_server.mode = "fair"  # asked as a model: "moo" about cows, else "I do not know"
    answers = EndpointSource(judge_server.url, concurrency=4).generate(prompts)
    assert answers == ["moo" if p is cow else "I do not know" for p in prompts]

    # The first request to arrive is refused (HTTP 400) and the server holds the others: the
    # error comes while they are still held (not once they are answered), and requests not yet
    # sent are not sent (2 workers: the held one and one more).
    judge_server.mode, before = "refuse_first", len(judge_server.requests)
    judge_server.release.clear()
    judge_server.refused, judge_server.held_answered = False, 0
    try:
        with pytest.raises(JudgeError, match="refused the request: HTTP 400"):
            EndpointSource(judge_server.url, concurrency=2).generate([cow] * 20)
        assert judge_server.held_answered == 0
        assert len(judge_server.requests) - before <= 3
    finally:
        judge_server.release.set()
        judge_server.mode = "fair"


def test_endpoint_without_the_batch_route_is_asked_one_chat_at_a_time():
    """A server that only offers chat gets chat requests; one that says it is vLLM is asked for
    a batch first, and when it has no batch route (vLLM before 0.32) the same answers come one
    chat at a time. Its own server: the shared one may still get a previous test's stragglers."""
    prompts = [[{"role": "user", "content": q}] for q in ("What does a cow say?", "Two plus two?")]
    server = JudgeServer()
    try:
        assert EndpointSource(server.url).generate(prompts) == ["moo", "I do not know"]
        assert server.paths == ["/v1/chat/completions"] * 2
        server.owned_by, server.paths = "vllm", []
        assert EndpointSource(server.url).generate(prompts) == ["moo", "I do not know"]
        assert server.paths == ["/v1/chat/completions/batch"] + ["/v1/chat/completions"] * 2
    finally:
        server.close()


def test_endpoint_that_is_not_openai_compatible_is_a_clear_error(judge_server):
    judge_server.mode = "html"  # e.g. a web server's page: the URL lacks /v1 or is another site
    try:
        with pytest.raises(JudgeError, match="not an OpenAI chat completion.*ending in /v1"):
            EndpointSource(judge_server.url).generate([[{"role": "user", "content": "hi"}]])
    finally:
        judge_server.mode = "fair"
    with pytest.raises(EvalError, match="concurrency 0: give at least 1"):
        EndpointSource(judge_server.url, concurrency=0)


def test_verdict_parsing():
    assert judge.parse_verdict("Answer A is better. [[A]]") == "A"
    assert judge.parse_verdict("[[tie]]") == "C"
    assert judge.parse_verdict("B") == "B"
    assert judge.parse_verdict("[[A]] or maybe [[B]]") is None
    assert judge.parse_verdict("A is nice, B is fine") is None


def test_unreachable_judge_is_a_clear_error(tmp_path, tiny_model):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "qa.jsonl").write_text(json.dumps({"instruction": "cow?", "output": "moo"}) + "\n")
    with pytest.raises(JudgeError, match="cannot reach.*running"):
        workbench.evaluate(str(tiny_model), tasks=["judge"], file=tmp_path / "qa.jsonl",
                           judge=f"http://127.0.0.1:{port}/v1", run_dir=tmp_path)
    assert not (tmp_path / "eval.jsonl").exists()


def test_lm_eval_local_task_and_bad_task_inputs(tmp_path, tiny_model):
    task = write_sounds_task(tmp_path)
    report = workbench.evaluate(str(tiny_model), tasks=[{"kind": "lm_eval", "tasks": [str(task)]}],
                                run_dir=tmp_path)
    line = report.lines[0]
    assert line["task"] == "lm_eval:wb_sounds" and line["n"] == 5
    assert 0.0 <= line["metrics"]["acc"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / line["examples"]).read_text().splitlines()]
    assert line["metrics"]["acc"] == sum(r["acc"] for r in rows) / 5  # per example, as scored
    assert json.loads((tmp_path / "eval.jsonl").read_text())["task"] == "lm_eval:wb_sounds"

    broken = tmp_path / "broken.yaml"
    broken.write_text(task.read_text().replace('doc_to_choice: "{{choices}}"\n', ""))
    with pytest.raises(EvalTaskError, match="has no doc_to_choice"):
        workbench.evaluate(str(tiny_model), tasks=[{"kind": "lm_eval", "tasks": [str(broken)]}])
    with pytest.raises(EvalTaskError, match="no task 'hellaswagg'.*did you mean hellaswag"):
        workbench.evaluate(str(tiny_model), tasks=["lm_eval:hellaswagg"])


def test_in_run_tasks_fit_the_runs_validation_split(tmp_path):
    from workbench.evaluate.callback import _fitting

    tasks = RunSpec.parse({"eval": {"tasks": ["heldout", "perplexity",
                                              {"kind": "heldout", "file": "qa.jsonl"}]}}).eval.tasks
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain prose, no answers"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    assert [t.kind for t in _fitting(tasks, chat)] == ["heldout", "perplexity", "heldout"]
    # Text rows have no answers: the default heldout becomes perplexity; a named file stays.
    assert [t.kind for t in _fitting(tasks, text)] == ["perplexity", "perplexity", "heldout"]
    assert [t.file for t in _fitting(tasks, None)] == ["qa.jsonl"]  # no split: only the file


def test_cli_scores_an_endpoint_on_a_file(tmp_path, judge_server):
    from workbench.cli import run

    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"instruction": "What does a cow say?", "output": "Moo"}) + "\n"
                  + json.dumps({"instruction": "What does a cat say?", "output": "meow"}) + "\n")
    table = run(["eval", "--endpoint", judge_server.url, "--tasks", "heldout", "--file", str(qa)])
    header, row = table.splitlines()
    assert row.split()[:4] == ["heldout", f"endpoint:{judge_server.url}", "0", "2"]
    assert "exact_match=0.5 " in row  # the server says moo to both: right once


def test_in_run_evaluation_stays_inside_the_budget(tmp_path):
    import time

    from workbench.evaluate.callback import EvalCallback
    from workbench.runs.budget import Billing
    from workbench.runs.rundir import RunDir

    # 1 per CPU-core hour on 2 cores, limit 1: one hour's budget, 10 s spent so far.
    spec = RunSpec.parse({"budget": {"price_per_cpu_core_hour": 1.0, "limit": 1.0}})
    billing = Billing(spec, {"attempt_started": time.time() - 10, "billed_before_s": 0.0})
    cb = EvalCallback(RunDir(tmp_path), spec, tokenizer=None, billing=billing)
    assert cb._affordable("after")
    cb.last_s = 3600.0  # the last evaluation took an hour: another would pass the limit
    assert not cb._affordable("after")
    unlimited = RunSpec()
    assert EvalCallback(RunDir(tmp_path), unlimited, None, Billing(unlimited), None)._affordable(
        "after")


def test_every_steps_scores_beside_only_where_the_node_has_room(tmp_path, monkeypatch):
    """No GPU here: device ids are strings in the lease files, as tests/test_leases.py does."""
    import os
    import subprocess

    from workbench.evaluate.beside import GPU_POOL_ENV, decide
    from workbench.runs.procs import ProcessIdentity
    from workbench.targets import leases

    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    # The machine's leases, for this test alone: the evaluation's lease below is held by this
    # (pytest's) process, which outlives the test.
    monkeypatch.setenv("WORKBENCH_LEASES", str(tmp_path / "leases"))
    cores = len(os.sched_getaffinity(0))
    assert decide("r", 0, cores).mode == "pause"  # one rank per core: no room
    if cores > 1:
        room = decide("r", 0, cores - 1)
        assert room.mode == "beside" and room.env["OMP_NUM_THREADS"] == "1"
    assert decide("r", 1, 1).mode == "pause"  # no pool (as under Slurm): nothing to lease
    holder = subprocess.Popen(["sleep", "600"])  # the run's supervisor, holding GPU 0
    try:
        leases.acquire("r", 1, ProcessIdentity.of(holder.pid, "supervisor"), devices=["0", "1"])
        monkeypatch.setenv(GPU_POOL_ENV, "0,1")
        room = decide("r", 1, 1)
        assert (room.mode, room.env["CUDA_VISIBLE_DEVICES"]) == ("beside", "1")
        # GPU 1 is now leased to r's evaluation: a second run with GPU 0 has none spare.
        other = decide("q", 1, 1)
        assert other.mode == "pause" and "held" in other.reason
    finally:
        holder.kill()
        holder.wait()
