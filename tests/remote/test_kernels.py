"""Remote kernels against the real sshd and the real one-machine Slurm cluster (conftest.py).

Each kernel is started the way Jupyter starts it: a KernelManager finds the kernelspec that
``workbench kernels install`` wrote, and jupyter_client loads the provisioner through the entry
point pyproject.toml declares. Cells run over the forwarded ports; afterwards nothing may be left:
no kernel process, no tunnel, no allocation in squeue.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import KernelManager

from tests.remote.cluster import processes_with, squeue_job_names
from workbench.cli import run as cli
from workbench.errors import RemoteKernelError, TargetError, WorkbenchError
from workbench.targets.named import SlurmTarget, SSHTarget, get_target, save_target

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernels(targets, tmp_path_factory) -> Iterator[Path]:
    """A private Jupyter data folder, a few more targets, and the provisioner's entry point as
    pyproject.toml declares it (the shared venv's editable install predates it)."""
    data = tmp_path_factory.mktemp("jupyter-data")
    site = tmp_path_factory.mktemp("entry-points")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    group = "jupyter_client.kernel_provisioners"
    info = site / "workbench_kernels_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: workbench-kernels-test\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in declared[group].items()))
    sys.path.insert(0, str(site))
    old = os.environ.get("JUPYTER_DATA_DIR")
    os.environ["JUPYTER_DATA_DIR"] = str(data)
    one = get_target("ssh:one")
    assert isinstance(one, SSHTarget)
    # A Python that exists but has no ipykernel (the system one; the venv is another).
    save_target(one.model_copy(update={"name": "noipykernel", "python": "/usr/bin/python3"}))
    login = get_target("slurm:login")
    assert isinstance(login, SlurmTarget)
    # 3,600 per GPU-hour: a GPU kernel costs 1 per second held.
    save_target(login.model_copy(update={"name": "gpu", "defaults": {
        "budget.price_per_gpu_hour": 3600.0, "budget.currency": "USD"}}))
    # An allocation that cannot start for an hour stands in for a busy partition.
    save_target(login.model_copy(update={"name": "busy", "sbatch_options": ["--begin=now+3600"]}))
    try:
        yield data
    finally:
        sys.path.remove(str(site))
        if old is None:
            os.environ.pop("JUPYTER_DATA_DIR", None)
        else:
            os.environ["JUPYTER_DATA_DIR"] = old


def _run_cell(km: KernelManager, code: str, timeout: float = 120) -> tuple[dict[str, Any], str]:
    """Execute ``code``; its reply content and everything it printed."""
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=timeout)
        printed: list[str] = []
        reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda m: printed.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        return reply["content"], "".join(printed)
    finally:
        kc.stop_channels()


def _interrupt_a_long_loop(km: KernelManager) -> dict[str, Any]:
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute("import time\nwhile True:\n    time.sleep(0.05)")
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the loop is running, not just sent
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id and \
                    msg["msg_type"] == "execute_input":
                break
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]
    finally:
        kc.stop_channels()


def _gone(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and pred():
        time.sleep(0.5)
    assert not pred(), what


def _kernel_jobs() -> list[str]:
    return [n for n in squeue_job_names() if n.startswith("wb-kernel-")]


def _squeue_of(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %b"], capture_output=True,
                          text=True).stdout.strip()


def test_kernels_install_list_remove(kernels):
    assert "installed kernel workbench-ssh-one" in cli(["kernels", "install", "ssh:one",
                                                         "--orphan-after", "2m"])
    table = cli(["kernels", "list"])
    assert "Workbench on one (CPU)" in table and "never" in table
    row = next(ln for ln in table.splitlines() if ln.startswith("workbench-ssh-one "))
    assert "01:00:00" not in row and " none " in row  # no time limit holds an SSH kernel
    assert "ORPHAN AFTER" in table and " 00:02:00 " in row
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("workbench-ssh-one")  # what the launcher lists
    assert spec.metadata["kernel_provisioner"]["config"]["target"] == "ssh:one"
    assert cli(["kernels", "remove", "ssh:one"]).startswith("removed ")
    assert "workbench-ssh-one" not in KernelSpecManager().find_kernel_specs()
    with pytest.raises(TargetError, match="not configured"):
        cli(["kernels", "install", "ssh:nope"])
    # Shorter than two of the client's 5 s beats, one late beat would end a kernel in use.
    with pytest.raises(WorkbenchError, match=r"--orphan-after must be at least 10s.*not 4s"):
        cli(["kernels", "install", "ssh:one", "--orphan-after", "4s"])
    assert "workbench-ssh-one" not in KernelSpecManager().find_kernel_specs()


def test_slurm_kernel_runs_in_its_allocation_and_ends_with_it(kernels, cluster):
    out = cli(["kernels", "install", "slurm:gpu", "--gpus", "1", "--time", "10m"])
    assert "Workbench on gpu (1 GPU)" in out
    km = KernelManager(kernel_name="workbench-slurm-gpu")
    km.start_kernel()
    try:
        reply, printed = _run_cell(km, "import os, socket\nprint(socket.gethostname(), "
                                   "os.environ['SLURM_JOB_ID'], os.environ['WORKBENCH_TARGET'])")
        assert reply["status"] == "ok", reply
        host, job, target = printed.split()
        assert host == socket.gethostname() and target == "slurm:gpu"
        state = _squeue_of(job)  # Slurm, asked with its own client, holds that allocation
        assert state.startswith("RUNNING") and "gpu:1" in state, state

        interrupted = _interrupt_a_long_loop(km)
        assert interrupted["status"] == "error" and interrupted["ename"] == "KeyboardInterrupt"
        reply, printed = _run_cell(km, "print(41 + 1)")  # the kernel lives on after it
        assert printed.strip() == "42"

        km.restart_kernel()
        _, printed = _run_cell(km, "import os\nprint(os.environ['SLURM_JOB_ID'])")
        assert printed.strip() != job  # a new allocation; the old one is released
        _gone(lambda: _squeue_of(job), f"job {job} still queued after the restart")
        job2 = printed.strip()
    finally:
        km.shutdown_kernel()
    _gone(_kernel_jobs, "a kernel allocation is left in squeue")
    _gone(lambda: processes_with(km.kernel_id), "a kernel process or tunnel is left")

    from workbench.targets.kernels.ledger import sessions

    bills = [s for s in sessions() if s["kernel_id"] == km.kernel_id]
    assert [b["job"] for b in bills] == [job, job2] and all(b["ended"] for b in bills)
    for b in bills:
        info = subprocess.run(["scontrol", "show", "job", "-o", b["job"]], capture_output=True,
                              text=True).stdout
        held = _seconds(info.split("RunTime=")[1].split()[0])
        # Every second Slurm held the GPU is billed (Slurm counts whole seconds).
        assert held - 1 <= b["billed_s"] <= held + 15, (b, held)
        assert b["cost"] == pytest.approx(b["billed_s"], rel=1e-6) and b["currency"] == "USD"


def _seconds(runtime: str) -> float:
    h, m, s = (int(x) for x in runtime.split("-")[-1].split(":"))
    return h * 3600 + m * 60 + s


def test_ssh_kernel_dropped_connection_is_dead_and_leaves_nothing(kernels, cluster):
    cli(["kernels", "install", "ssh:one"])
    km = KernelManager(kernel_name="workbench-ssh-one")
    km.start_kernel()
    try:
        reply, printed = _run_cell(km, "import os, socket\nprint(socket.gethostname(), "
                                   "os.environ['WORKBENCH_TARGET'], os.getcwd())")
        host, target, cwd = printed.split()
        assert (host, target) == (socket.gethostname(), "ssh:one")
        assert cwd == get_target("ssh:one").workdir  # the node's files, not the notebook's
        assert processes_with(km.kernel_id)  # the kernel runs, started over SSH
        tunnel = km.provisioner.tunnel  # type: ignore[union-attr]
        os.kill(tunnel.proc.pid, signal.SIGKILL)  # the SSH connection drops
        _gone(km.is_alive, "the kernel is still reported alive after its connection dropped")
        assert "dropped" in km.provisioner.dead_reason  # type: ignore[union-attr]
        _gone(lambda: processes_with(km.kernel_id), "the remote kernel outlived its connection")
    finally:
        km.shutdown_kernel(now=True)


def test_unreachable_host_says_so(kernels):
    cli(["kernels", "install", "ssh:down"])
    km = KernelManager(kernel_name="workbench-ssh-down")
    with pytest.raises(RemoteKernelError, match=r"cannot reach 127\.0\.0\.1.*\n-> "):
        km.start_kernel()


def test_python_without_ipykernel_says_what_to_install(kernels):
    cli(["kernels", "install", "ssh:noipykernel"])
    km = KernelManager(kernel_name="workbench-ssh-noipykernel")
    with pytest.raises(RemoteKernelError, match="(?s)cannot import ipykernel.*pip install ipykernel"):
        km.start_kernel()
    assert not processes_with(km.kernel_id)


def test_allocation_that_does_not_start_in_time_is_cancelled(kernels):
    cli(["kernels", "install", "slurm:busy", "--wait", "5s"])
    km = KernelManager(kernel_name="workbench-slurm-busy")
    with pytest.raises(RemoteKernelError, match=r"(?s)within 5 s.*BeginTime.*cancelled"):
        km.start_kernel()
    _gone(_kernel_jobs, "the pending allocation was left in the queue", timeout=30)


def test_launch_in_a_remote_kernel_defaults_to_its_target(kernels, monkeypatch):
    import workbench
    from workbench.runs.registry import Registry

    # What the provisioner sets in the kernel; a target whose sbatch refuses fails fast.
    monkeypatch.setenv("WORKBENCH_TARGET", "slurm:nopart")
    with pytest.raises(TargetError, match="partition"):
        workbench.launch({"name": "inkernel", "train": {"max_steps": 2}})
    assert Registry().get_run("inkernel").target == "slurm:nopart"


def test_idle_kernel_is_culled_and_its_bill_closed(kernels):
    cli(["kernels", "install", "ssh:one", "--cull-idle", "4s"])
    km = KernelManager(kernel_name="workbench-ssh-one")
    km.start_kernel()
    try:
        reply, _ = _run_cell(km, "import time\ntime.sleep(8)")  # busy twice the limit
        assert reply["status"] == "ok"  # a running cell is not idle
        _gone(km.is_alive, "the idle kernel was not culled")
        assert "culled after 4 s idle" in km.provisioner.dead_reason  # type: ignore[union-attr]
        _gone(lambda: processes_with(km.kernel_id), "the culled kernel still runs")
    finally:
        km.shutdown_kernel(now=True)
    from workbench.targets.kernels.ledger import sessions

    (bill,) = [s for s in sessions() if s["kernel_id"] == km.kernel_id]
    assert bill["ended"] and bill["reason"].startswith("culled")


def test_a_kernel_stops_within_its_budget_and_cannot_start_past_it(kernels, cluster):
    # slurm:gpu costs 1 USD per second held with one GPU: a 30 USD kernel has about 15 s to run
    # before what is left covers only its next look and its release.
    cli(["kernels", "install", "slurm:gpu", "--gpus", "1", "--time", "10m", "--budget", "30"])
    km = KernelManager(kernel_name="workbench-slurm-gpu")
    km.start_kernel()
    try:
        reply, printed = _run_cell(km, "import os\nprint(os.environ['SLURM_JOB_ID'])")
        assert reply["status"] == "ok", reply
        job = printed.strip()
        _gone(km.is_alive, "the kernel ran on past its budget", timeout=120)
        assert "stopped at its budget" in km.provisioner.dead_reason  # type: ignore[union-attr]
        _gone(lambda: _squeue_of(job), f"job {job} still holds its GPU after the budget stop")
    finally:
        km.shutdown_kernel(now=True)
    from workbench.targets.kernels.ledger import sessions

    (bill,) = [s for s in sessions() if s["kernel_id"] == km.kernel_id]
    info = subprocess.run(["scontrol", "show", "job", "-o", bill["job"]], capture_output=True,
                          text=True).stdout
    held = _seconds(info.split("RunTime=")[1].split()[0])
    assert held - 1 <= bill["billed_s"]  # every second Slurm held the GPU is on the bill
    assert bill["cost"] <= 30.0  # and the bill kept the budget
    # Starting it again would pass the budget: refused before anything is allocated.
    again = KernelManager(kernel_name="workbench-slurm-gpu")
    again.kernel_id = km.kernel_id  # the same kernel, as a restart keeps its id
    with pytest.raises(RemoteKernelError, match="budget of 30 USD is spent"):
        again.start_kernel()
    assert not _kernel_jobs()


def test_a_kernelspec_written_with_a_too_short_orphan_time_is_refused_at_start(kernels):
    cli(["kernels", "install", "ssh:one"])
    path = kernels / "kernels" / "workbench-ssh-one" / "kernel.json"
    installed = path.read_text()
    raw = json.loads(installed)
    raw["metadata"]["kernel_provisioner"]["config"]["orphan_after_s"] = 3
    path.write_text(json.dumps(raw))
    try:
        km = KernelManager(kernel_name="workbench-ssh-one")
        with pytest.raises(RemoteKernelError, match=r"orphan_after_s is 3 s: under 10 s.*again"):
            km.start_kernel()
        assert not km.is_alive()
    finally:
        path.write_text(installed)


def test_a_kernel_budget_without_a_price_is_refused(kernels):
    cli(["kernels", "install", "ssh:one", "--budget", "5"])  # ssh:one has no price
    km = KernelManager(kernel_name="workbench-ssh-one")
    with pytest.raises(RemoteKernelError, match="has no price"):
        km.start_kernel()
    assert not km.is_alive()
