"""Pruning on remote targets, against the test cluster and sshd.

A run on an SSH host cancelled with a prune request ends ``pruned`` on the host. A sweep on a Slurm
target (sbatch over SSH on the login node, run directories copied to the cluster's workdir, one
Slurm job per trial) runs two trials one after the other: a learning rate that learns, then one
too small to learn, which the median pruner stops at its second evaluation; the prune request must
reach the job's supervisor on the cluster, so the run ends ``pruned`` there (not ``cancelled``).
CPU time is priced at 3,600 per process-core-hour and each run has one process: one unit per
second a run holds its job, so the budget is a number of seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench
from tests.remote.cluster import squeue_job_names
from tests.waiting import wait_for
from workbench.runs.registry import Registry
from workbench.runs.rundir import PRUNE_REQUEST

pytestmark = pytest.mark.slow
GOOD, BAD = 3e-3, 1e-7
# Room for both trials even on a busy machine (a trial priced x1.5 must fit in what is left).
BUDGET = 3000.0
PER_SECOND = 1.0  # at 3,600 per process-core-hour, one process
MAX_STEPS = 400


@pytest.fixture(scope="module")
def slurm_sweep(targets):
    spec = {"name": "swslurm", "target": "slurm:login", "resources": {"processes_per_node": 1},
            # Evaluations at steps 2, 4, ...: the pruner judges at step 4, and the request then
            # travels (controller poll, SSH, the supervisor's next read) while the job trains on.
            # On an idle machine a step takes ~30 ms and the round trip seconds: 20 and then 100
            # steps were over before it landed. 400 leave room either way, since a loaded
            # machine slows the steps and the round trip alike.
            "train": {"max_steps": MAX_STEPS, "eval_every": 2, "lr": GOOD},
            "data": {"eval_samples": 8}, "checkpoint": {"keep": 1},
            "budget": {"price_per_cpu_core_hour": 3600.0}}
    sweep = workbench.sweep(spec, space={"train.lr": [BAD, GOOD]}, concurrent=1, budget=BUDGET,
                            prune_after=1)
    state = sweep.wait(progress=False, timeout=900)
    yield sweep, state
    if not sweep.done:  # a failed test leaves no controller behind
        sweep.cancel()


def test_a_prune_request_reaches_the_supervisor_on_an_ssh_host(targets, cluster):
    """The cancel path with a reason, over SSH: the host's own status.json records it."""
    job = workbench.launch({"name": "prunessh", "target": "ssh:one",
                            "resources": {"processes_per_node": 1},
                            "train": {"max_steps": 100000}})
    wait_for(lambda: (job.status().get("step") or 0) >= 1, 300, "the first step", every=0.5)
    assert job.cancel(stop_request=PRUNE_REQUEST) == "pruned"
    assert workbench.get_job(job.id).state == "pruned"
    on_host = json.loads((cluster.root / "work" / "one" / job.id / "status.json").read_text())
    assert (on_host["state"], on_host["stop_request"]) == ("pruned", "prune")
    assert "released" in job.status()  # the supervisor closed the bill


def _trials(sweep) -> dict[int, dict]:
    return {t["number"]: t for t in sweep.trials}


def test_the_worse_trial_is_pruned_on_the_cluster(slurm_sweep, cluster):
    sweep, state = slurm_sweep
    log = sweep.record.log_file.read_text()[-3000:]
    assert state == "succeeded", log
    trials = _trials(sweep)
    # Optuna's grid sampler with the sweep's seed (0) tries the second point first.
    assert trials[0]["params"] == {"train.lr": GOOD}, "the grid order changed: swap the points"
    assert trials[0]["state"] == "succeeded" and trials[0]["value"] is not None, log
    assert trials[1]["state"] == "pruned", log
    pruned = Registry().get_run(trials[1]["run_id"])
    assert pruned.state == "pruned"
    # The supervisor on the cluster recorded it (not only the local mirror).
    on_cluster = cluster.root / "work" / "cluster" / pruned.id / "status.json"
    remote = json.loads(on_cluster.read_text())
    assert (remote["state"], remote["stop_request"]) == ("pruned", "prune")
    assert remote["step"] < MAX_STEPS  # stopped short
    assert not [n for n in squeue_job_names() if pruned.id[:50] in n]  # the job left the queue
    import optuna

    study = optuna.load_study(study_name="sweep", storage=sweep.record.study_url)
    told = {t.number: t.state for t in study.trials}
    assert told == {0: optuna.trial.TrialState.COMPLETE, 1: optuna.trial.TrialState.PRUNED}


def test_every_trial_has_its_bill_and_the_sweep_stays_within_budget(slurm_sweep):
    sweep, _ = slurm_sweep
    spent = 0.0
    for t in _trials(sweep).values():
        status = json.loads((Path(Registry().get_run(t["run_id"]).run_dir) / "status.json")
                            .read_text())
        assert "released" in status, status  # the supervisor closed the bill
        assert status["cost"] == pytest.approx(PER_SECOND * status["billed_s"], rel=1e-6)
        assert t["cost"] == pytest.approx(status["cost"]) and t["cost_final"]
        spent += status["cost"]
    assert 0 < spent <= BUDGET
    assert sweep.spent == pytest.approx(spent)
