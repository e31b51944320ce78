"""A remote kernel driven from JupyterLab in headless Chromium, on the real test Slurm cluster.

``workbench kernels install`` writes the kernelspecs into a folder on the lab server's
JUPYTER_PATH; the launcher lists them; the Slurm one ("Workbench on login (1 GPU)": sbatch over
SSH on the login node, ports forwarded through it) is started from its launcher card. A cell
prints the node's hostname and SLURM_JOB_ID, a busy loop is interrupted from the toolbar, the
kernel is restarted and shut down from the Kernel menu. Afterwards no kernel process and no
kernel allocation is left, and the server logged no traceback. Screenshots go to
``tests/lab/artifacts/``.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.lab.browser import accept_kernel_dialog, browser_page, open_lab, shot
from tests.lab.conftest import LabServer, running_lab, wait_for
from tests.remote.cluster import processes_with, squeue_job_names
from workbench.cli import run as cli

SLURM_KERNEL = "Workbench on login (1 GPU)"
SSH_KERNEL = "Workbench on one (CPU)"


@pytest.fixture(scope="module")
def lab(targets, wb_home: Path, tmp_path_factory) -> Iterator[LabServer]:
    """JupyterLab whose kernel path holds the kernelspecs `workbench kernels install` wrote."""
    state = tmp_path_factory.mktemp("jupyter-remote-kernels")
    data = state / "data"  # as `jupyter --data-dir`: where `kernels install` writes
    env = {"JUPYTER_DATA_DIR": str(data)}
    # The CLI (in this process) writes into the folder the server reads its kernelspecs from.
    old = os.environ.get("JUPYTER_DATA_DIR")
    os.environ["JUPYTER_DATA_DIR"] = str(data)
    try:
        assert SLURM_KERNEL in cli(["kernels", "install", "slurm:login", "--gpus", "1",
                                    "--time", "10m"])
        cli(["kernels", "install", "ssh:one"])
    finally:
        if old is None:
            os.environ.pop("JUPYTER_DATA_DIR")
        else:
            os.environ["JUPYTER_DATA_DIR"] = old
    assert (data / "kernels" / "workbench-slurm-login" / "kernel.json").is_file()
    with running_lab(wb_home, state, "jupyter-server-remote-kernels.log", env) as server:
        yield server


@pytest.fixture(scope="module")
def page(lab: LabServer):
    with browser_page() as page:
        yield page


def _run_cell(page, code: str):
    """Type ``code`` into the notebook's last (empty, active) cell and run it with Shift+Enter,
    which adds the next empty cell; the cell that ran."""
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    cell = cells.nth(cells.count() - 1)
    page.evaluate("code => window.jupyterapp.shell.currentWidget.content.activeCell.model"
                  ".sharedModel.setSource(code)", code)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    return cell


def _wait_output(cell, text: str, timeout_s: float) -> str:
    cell.locator(".jp-OutputArea-output", has_text=text).first.wait_for(timeout=timeout_s * 1000)
    return cell.locator(".jp-OutputArea").inner_text()


def _kernel_menu(page, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                 has_text=item).first.click()


def _idle(page, timeout_s: float = 180) -> None:
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(
        timeout=timeout_s * 1000)


def _queued(job_ids: list[str]) -> list[str]:
    """Those of ``job_ids`` still in squeue (pending, running or completing)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return [j for j in out.split() if j in job_ids]


def _running_jobs_of(kernel_id: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-n", f"wb-kernel-{kernel_id}", "-o",
                          "%i"], capture_output=True, text=True).stdout
    return out.split()


def test_slurm_kernel_from_the_launcher_runs_interrupts_restarts_and_leaves_nothing(
        page, lab: LabServer, cluster) -> None:
    open_lab(page, lab)
    page.evaluate("() => { window.jupyterapp.commands.execute('launcher:create'); }")
    launcher = page.locator(".jp-Launcher").first
    launcher.locator(".jp-LauncherCard", has_text=SSH_KERNEL).first.wait_for()
    card = launcher.locator(".jp-LauncherCard", has_text=SLURM_KERNEL).first
    card.wait_for()
    shot(page, "remote-01-launcher")
    card.click()
    page.locator(".jp-Toolbar-kernelName", has_text=SLURM_KERNEL).first.wait_for()
    _idle(page)  # sbatch over SSH, the allocation running, the ports forwarded
    (kernel,) = requests.get(f"{lab.url}/api/kernels", headers=lab.auth, timeout=10).json()
    assert kernel["name"] == "workbench-slurm-login"
    kernel_id = kernel["id"]
    assert processes_with(kernel_id), "no kernel process runs for the kernel the lab started"

    cell = _run_cell(page, "import os, socket\n"
                     "print('HOST', socket.gethostname(), 'JOB', os.environ['SLURM_JOB_ID'])")
    words = _wait_output(cell, "JOB", 120).split()
    host, job = words[words.index("HOST") + 1], words[words.index("JOB") + 1]
    assert host == socket.gethostname()  # the (one) node of the test cluster
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%j|%b"], capture_output=True,
                           text=True).stdout.strip().split("|")
    assert state[:2] == ["RUNNING", f"wb-kernel-{kernel_id}"], state  # the lab's kernel's job
    assert "gpu:1" in state[2], state  # Slurm holds the GPU the kernelspec asked for
    shot(page, "remote-02-hostname-and-job")

    # The loop prints first, so the interrupt lands in a running cell, not a queued one.
    cell = _run_cell(page, "print('looping', flush=True)\nwhile True:\n    pass")
    _wait_output(cell, "looping", 60)
    page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()
    _wait_output(cell, "KeyboardInterrupt", 60)
    _idle(page, 60)
    shot(page, "remote-03-interrupted")

    _kernel_menu(page, "Restart Kernel…")
    page.locator(".jp-Dialog .jp-mod-accept", has_text="Restart").click()
    # The restart has reached Slurm (a page still showing "idle" from before proves nothing).
    (new_job,) = wait_for(lambda: [j for j in _running_jobs_of(kernel_id) if j != job], 180,
                          "the restarted kernel's new allocation to run")
    _idle(page)
    cell = _run_cell(page, "import os\nprint('AFTER', os.environ['SLURM_JOB_ID'])")
    words = _wait_output(cell, "AFTER", 180).split()
    job2 = words[words.index("AFTER") + 1]
    assert job2 == new_job != job  # a restart is a new allocation
    wait_for(lambda: not _queued([job]), 60, f"job {job} to leave squeue after the restart")
    shot(page, "remote-04-restarted")

    _kernel_menu(page, "Shut Down Kernel")
    wait_for(lambda: (accept_kernel_dialog(page), requests.get(
        f"{lab.url}/api/kernels", headers=lab.auth, timeout=10).json() == [])[1], 120,
        "the server to drop the kernel")
    page.locator(".jp-Toolbar-kernelName", has_text="No Kernel").first.wait_for()
    shot(page, "remote-05-shut-down")
    wait_for(lambda: not _queued([job, job2]), 60, "the kernel's allocation to leave squeue")
    # The tests before this one leave nothing in the queue either: it is empty.
    wait_for(lambda: not squeue_job_names(), 60, "squeue to be empty")
    wait_for(lambda: not processes_with(kernel_id), 60, "the kernel's processes to end")
    log = lab.log.read_text()
    assert "Traceback" not in log, log[-3000:]
