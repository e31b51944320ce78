"""A run started from a notebook outlives a kernel restart and is found again by name.

A real IPython kernel driven by nbclient (as a notebook front end drives it): one cell launches
a run of the built-in tiny model, the kernel is restarted while the run trains, and a cell in the
fresh kernel finds the run with ``workbench.get_job(name)`` and waits for it to succeed.
"""

from __future__ import annotations

import secrets

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

import workbench
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def _wait_for(cond, timeout: float, what: str):
    return wait_for(cond, timeout, what, every=0.5)


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def test_a_run_outlives_a_kernel_restart_and_is_found_again_by_name():
    name = f"restart-{secrets.token_hex(3)}"
    launch = nbformat.v4.new_code_cell(
        "import workbench\n"
        f"job = workbench.launch({{'name': '{name}', 'train': {{'max_steps': 12, 'log_every': 1}},"
        " 'data': {'validation_fraction': 0.0}})\n"
        "print(job.id)")
    find = nbformat.v4.new_code_cell(
        "import workbench\n"
        f"again = workbench.get_job('{name}')\n"
        "print(again.id, again.wait(timeout=600, progress=False))")
    nb = nbformat.v4.new_notebook(cells=[launch, find])
    client = NotebookClient(nb, kernel_name="python3", timeout=600)
    with client.setup_kernel():
        client.execute_cell(launch, 0)
        run_id = _stdout(launch).strip()
        job = workbench.get_job(run_id)
        assert job.name == name
        _wait_for(lambda: any("loss" in m for m in job.metrics()), 300, "a first training step")
        old_kernel = client.km.provisioner.process.pid
        run_sync(client.km.restart_kernel)(now=True)  # what the notebook's Restart does
        assert client.km.provisioner.process.pid != old_kernel
        assert not psutil.pid_exists(old_kernel) or psutil.Process(old_kernel).status() == \
            psutil.STATUS_ZOMBIE
        # The kernel that launched it is gone; the run trains on.
        assert job.state == "running", job.status()
        run_sync(client.kc.wait_for_ready)(timeout=120)
        client.execute_cell(find, 1)
    found_id, state = _stdout(find).split()
    assert found_id == run_id and state == "succeeded", _stdout(find)
    steps = [m["step"] for m in job.metrics() if "loss" in m]
    assert steps == list(range(1, 13))  # one attempt, not restarted with the kernel
    assert not job.status().get("restarts")
