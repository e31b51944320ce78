"""DPO, ORPO, KTO and GRPO train for real through launch() on the built-in tiny model.

Every stage runs in 2 processes: DPO, ORPO and GRPO under DDP over gloo, KTO under ZeRO-2. Every
stage is killed -9 mid-run and resumes from its snapshot: DPO and GRPO on a separate uninterrupted
run's curve, step for step; ORPO and KTO on their own first attempt's steps past the snapshot,
which they train twice. Every stage's run is shared with tests/test_serve.py (its adapter served
by vLLM) through tests/preference_runs.py. GRPO also scores
with a user's reward function from a folder the ranks do not have on their path (launch ships it
with the run). Steps and data are tiny: these check the path (data, TRL trainer, our callbacks,
snapshots, artefacts), not what the model learns (the preference notebook does that).
"""

from __future__ import annotations

import pytest

from tests.preference_runs import (
    DPO_STEPS,
    GRPO_STEPS,
    KILL_CHECKPOINT,
    KTO_STEPS,
    ORPO_STEPS,
    USER_REWARD,
    grpo_spec,
    kill_rank_1_and_resume,
    launch_held,
    pref_data,
    pref_spec,
    train_lines,
)

pytestmark = pytest.mark.slow


def _same_curve(reference, job, keys: tuple[str, ...], steps) -> None:
    a = {m["step"]: m for m in train_lines(reference)}
    b = {m["step"]: m for m in train_lines(job)}
    for step in steps:
        for key in keys:
            # KTO logs a chosen/rejected metric only for a batch that holds such an example.
            assert (key in b[step]) == (key in a[step]), (step, key)
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)


def test_dpo_in_two_processes_logs_reward_margins_and_accuracies(dpo_job):
    assert dpo_job.status()["world_size"] == 2
    lines = train_lines(dpo_job)
    assert [m["step"] for m in lines] == list(range(1, DPO_STEPS + 1))
    for key in ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"):
        assert all(isinstance(m[key], float) for m in lines), key
    # The policy moves off its reference: margins start at 0 (policy == reference) and leave it.
    assert lines[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(m["rewards/margins"]) > 1e-4 for m in lines[1:])
    df = dpo_job.metrics_df()
    assert {"loss", "rewards/margins", "rewards/accuracies"} <= set(df.columns)
    assert "reference: implicit" in dpo_job.logs(tail=None, name="rank-0.log")
    # The default eval: (heldout after training) answers SFT prompts: a DPO run scores none of
    # it, its log says so, and its plan prices none of it and says why.
    from workbench.evaluate import results
    from workbench.plan import plan

    assert not (dpo_job.run_dir.path / results.FILE).exists()
    assert "not scored in this run" in dpo_job.logs(tail=None, name="rank-0.log")
    planned = plan(dpo_job.spec)
    assert planned.clock["scoring_s"] == 0 and "a dpo run" in planned.clock["scoring"]
    # Its live view opens on what shows a preference being learnt, not on the loss.
    from workbench.widgets.job_view import JobView

    assert JobView(dpo_job, autostart=False).chart.metric.value == "rewards/margins"


def test_dpo_killed_mid_run_resumes_on_the_same_curve(dpo_job, tmp_path_factory):
    job, hold = launch_held(pref_spec("dpo-kill", "dpo", pref_data(tmp_path_factory, "pairs"),
                                      DPO_STEPS, checkpoint=KILL_CHECKPOINT),
                            KILL_CHECKPOINT["every_steps"], tmp_path_factory.mktemp("hold"))
    at = kill_rank_1_and_resume(job, hold, DPO_STEPS)
    _same_curve(dpo_job, job, ("loss", "rewards/margins"), range(at + 1, DPO_STEPS + 1))


def _same_as_first_attempt(job, keys: tuple[str, ...]) -> None:
    """The run was killed after its snapshot and after training on past it: the steps the first
    attempt trained past the snapshot (uninterrupted until the kill) were trained again after
    the resume, and must have come out the same, step for step."""
    raw = [m for m in job.run_dir.metrics() if "loss" in m or m.get("event") == "resume"]
    cut = next(i for i, m in enumerate(raw) if m.get("event") == "resume")
    at = raw[cut]["step"]
    first = {m["step"]: m for m in raw[:cut]}
    again = {m["step"]: m for m in raw[cut + 1:]}
    overlap = [step for step in first if step > at]
    assert overlap, (at, sorted(first))
    for step in overlap:
        for key in keys:
            # KTO logs a chosen/rejected metric only for a batch that holds such an example.
            assert (key in again[step]) == (key in first[step]), (step, key)
            if key in first[step]:
                assert again[step][key] == pytest.approx(first[step][key], rel=1e-4,
                                                         abs=1e-5), (step, key)


def test_kto_under_zero2_in_two_processes_killed_and_resumed(kto_job):
    """kto_job was killed -9 after its snapshot, a ZeRO-2 (DeepSpeed) one, and resumed."""
    job = kto_job
    _same_as_first_attempt(job, ("loss", "kl", "rewards/margins", "logps/chosen", "logps/rejected"))
    assert "lora + zero2" in job.logs(tail=None, name="rank-0.log")
    lines = train_lines(job)
    assert [m["step"] for m in lines] == list(range(1, KTO_STEPS + 1))
    assert all("kl" in m for m in lines), lines[0]


def test_orpo_in_two_processes_trains_with_no_reference_killed_and_resumed(orpo_job):
    """orpo_job was killed -9 after its snapshot and resumed (tests/preference_runs.py)."""
    _same_as_first_attempt(orpo_job, ("loss", "rewards/margins", "nll_loss", "log_odds_ratio"))
    assert orpo_job.status()["world_size"] == 2
    lines = train_lines(orpo_job)
    assert [m["step"] for m in lines] == list(range(1, ORPO_STEPS + 1))
    assert all("rewards/margins" in m and "rewards/accuracies" in m for m in lines), lines[0]
    assert "reference:" not in orpo_job.logs(tail=None, name="rank-0.log")


# -- GRPO: 2 processes, a user's reward shipped with the run, killed -9 and resumed -------------

def test_grpo_in_two_processes_logs_rewards_spread_and_kl_with_a_shipped_user_reward(grpo_job):
    assert grpo_job.status()["world_size"] == 2
    lines = train_lines(grpo_job)
    assert [m["step"] for m in lines] == list(range(1, GRPO_STEPS + 1))
    for m in lines:
        assert {"reward", "reward_std", "kl", "rewards/length/mean",
                "rewards/exact_match/mean"} <= set(m)
        assert 0.0 <= m["rewards/length/mean"] <= 1.0
        # The user's function scored every completion of both ranks (0.25 each, no spread).
        assert m["rewards/quarter/mean"] == pytest.approx(0.25)
        assert m["rewards/quarter/std"] == pytest.approx(0.0)
    # Random tokens differ in length, so the length reward has a spread to learn from.
    assert any(m["reward_std"] > 0 for m in lines)
    from workbench.widgets.job_view import JobView

    assert JobView(grpo_job, autostart=False).chart.metric.value == "reward"  # GRPO's loss is ~0
    shipped = grpo_job.run_dir.path / "data" / "rewards" / "wb_pref_reward.py"
    assert shipped.read_text() == USER_REWARD
    for rank in (0, 1):  # each rank imported the run's copy, not the notebook's folder
        assert f"wb_pref_reward imported from {shipped}" in grpo_job.logs(
            tail=None, name=f"rank-{rank}.log")


def test_grpo_killed_mid_run_resumes_from_its_snapshot_on_the_same_curve(grpo_job,
                                                                         tmp_path_factory):
    job, hold = launch_held(grpo_spec("grpo-kill", pref_data(tmp_path_factory, "prompts")),
                            KILL_CHECKPOINT["every_steps"], tmp_path_factory.mktemp("hold"))
    kill_rank_1_and_resume(job, hold, GRPO_STEPS)
    # Sampling is seeded (per rank) and the snapshot holds every rank's RNG state, so the resumed
    # run samples the same completions and gets the same rewards as the uninterrupted one.
    _same_curve(grpo_job, job, ("loss", "reward", "reward_std", "rewards/length/mean", "kl",
                                "completions/mean_length"), range(1, GRPO_STEPS + 1))
