"""Fixtures for remote targets: a real one-machine Slurm cluster and a real sshd on loopback.

Both come up once per test session (``tests/remote/cluster.py``) under a temporary folder and
are stopped by PID at the end. ``targets`` writes WORKBENCH_HOME/targets.yaml with the targets
the tests use; every "remote" working directory is a separate folder on this machine.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.remote import cluster as test_cluster  # the project's own set-up script, beside this

PYTHON = sys.executable  # the venv: what every target runs in this test world


@pytest.fixture(scope="session")
def cluster() -> Iterator[test_cluster.Cluster]:
    root = Path(tempfile.mkdtemp(prefix="workbench-cluster-"))
    c = test_cluster.up(root)
    os.environ["SLURM_CONF"] = str(c.slurm_conf)  # sbatch/squeue/scontrol of this cluster
    try:
        yield c
    finally:
        # Jobs a failed test left behind go first, then the daemons, by PID.
        test_cluster.down(root)
        os.environ.pop("SLURM_CONF", None)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def target_home(cluster: test_cluster.Cluster) -> Path:
    """The home folder of ssh:apart's and slurm:apart's user. The hosts are this machine, so the
    files are one filesystem; what keeps a folder of the targets out of the notebook's view is
    the home: ``~/models/X`` is TARGET_HOME/models/X there and ~/models/X (HOME of this test
    process) here, which does not exist (tests assert that)."""
    home = cluster.root / "target-home"
    home.mkdir(exist_ok=True)
    return home


@pytest.fixture(scope="session")
def cluster_model(target_home: Path) -> tuple[str, Path]:
    """(model.id, folder on the targets) of a model that only ssh:apart and slurm:apart have:
    builtin:tiny-llama cut to its first layer, so its shape differs from the built-in's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.assets import builtin_model_path

    model_id = "~/models/wb-cluster-only-tiny"
    folder = target_home / "models" / "wb-cluster-only-tiny"
    assert not Path(os.path.expanduser(model_id)).exists()  # here it must name nothing
    if not (folder / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(builtin_model_path())
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(builtin_model_path()).save_pretrained(folder)
    return model_id, folder


@pytest.fixture(scope="session")
def targets(cluster: test_cluster.Cluster, wb_home: Path, target_home: Path) -> dict:
    # Every "host" runs the workbench under test: PYTHON is this venv, whose editable install
    # imports this checkout's package (nothing of this process's env goes over SSH).
    # Every target here is this one machine: the launches leave measuring it to the tests about
    # calibration (which turn the launch probe back on), instead of a probe job per target.
    from workbench.plan.probe import LAUNCH_PROBE_ENV

    os.environ[LAUNCH_PROBE_ENV] = "0"
    env = {"WORKBENCH_HOME": str(wb_home), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "SLURM_CONF": str(cluster.slurm_conf),
           LAUNCH_PROBE_ENV: "0"}
    from workbench.serve import serving_python

    # vLLM lives in its own environment (.venv-serve), as on real clusters.
    ssh = {"python": PYTHON, "serve_python": serving_python(), "ssh_config": str(cluster.ssh_config),
           "env": env}
    work = cluster.root / "work"
    linger = cluster.root / "linger-python"  # the venv's python, then a wait inside the job
    data = {
        "ssh": {
            # Two machines that share nothing: each host has its own working directory.
            "pair": {**ssh, "hosts": [{"host": "wb-node0", "workdir": f"{work}/node0"},
                                      {"host": "wb-node1", "workdir": f"{work}/node1"}],
                     "defaults": {"resources.nodes": 2, "resources.processes_per_node": 1}},
            "one": {**ssh, "hosts": ["wb-node0"], "workdir": f"{work}/one"},
            # The same host, logged into as a user whose home is not the notebook's (see
            # target_home): ~/... names a folder there that does not exist here.
            "apart": {**ssh, "env": {**env, "HOME": str(target_home)}, "hosts": ["wb-node0"],
                      "workdir": f"{work}/one"},
            "down": {**ssh, "hosts": [{"host": "127.0.0.1", "port": 1}], "connect_timeout": 5},
            "broken": {**ssh, "hosts": ["wb-node0"], "python": "/nonexistent/env/bin/python"},
            "unknown-key": {"python": PYTHON, "env": env,
                            "hosts": [{"host": "127.0.0.1", "port": cluster.ssh_port}],
                            "identity_file": str(cluster.identity),
                            "known_hosts": str(cluster.root / "empty_known_hosts")},
        },
        "slurm": {
            # The notebook runs on the login node: sbatch here, run directory used in place.
            "local": {"python": PYTHON, "serve_python": serving_python(), "env": env,
                      "time": "00:10:00"},
            # sbatch over SSH on a login node, run directory copied to the cluster's workdir.
            "login": {**ssh, "login": "wb-node0", "workdir": f"{work}/cluster", "time": "00:10:00"},
            # ... and a cluster whose users' home (its shared filesystem) is not the notebook's.
            "apart": {**ssh, "env": {**env, "HOME": str(target_home)}, "login": "wb-node0",
                      "workdir": f"{work}/cluster", "time": "00:10:00"},
            "short": {"python": PYTHON, "env": env, "time": "1", "cpus_per_task": 1,
                      # Inside the job only: stands in for a run longer than its limit.
                      "setup": ['[ -z "$SLURM_JOB_ID" ] || sleep 600']},
            "nopart": {"python": PYTHON, "env": env, "partition": "nope"},
            # More memory than the node has (20000 MB): sbatch itself refuses the job.
            "bigmem": {"python": PYTHON, "env": env, "mem": "64G"},
            # sbatch --hold: the job waits in the queue (reason JobHeldUser) until released.
            "held": {"python": PYTHON, "env": env, "time": "00:10:00",
                     "sbatch_options": ["--hold"]},
            "broken": {"python": "/nonexistent/env/bin/python", "env": env},
            # The job goes on after the run recorded its outcome, until its limit or a scancel.
            "linger": {"python": str(linger), "env": env, "time": "2", "cpus_per_task": 1},
            "lingerlong": {"python": str(linger), "env": env, "time": "30", "cpus_per_task": 1},
        },
    }
    (cluster.root / "empty_known_hosts").write_text("")
    linger.write_text(f"#!/bin/bash\n{shlex.quote(PYTHON)} \"$@\"\nrc=$?\n"
                      # Only the supervisor step lingers, as a slow bundle or unmount would.
                      'case " $* " in *" -m workbench.runs.supervise "*) sleep 600;; esac\nexit $rc\n')
    linger.chmod(0o755)
    (wb_home / "targets.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return data
