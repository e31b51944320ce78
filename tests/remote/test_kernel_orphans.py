"""A remote kernel whose client is killed -9 ends on its own within the bound docs/kernels.md
states, releases its Slurm allocation, and is billed for the life its target saw.

The client is a separate Python process holding a KernelManager, as a Jupyter server does; it
starts the kernel from the kernelspec ``workbench kernels install`` wrote, runs a cell, and is
then killed with SIGKILL (no clean-up of any kind runs). What the test compares the bill with is
observed here, not computed by Workbench: the kernel process's start from /proc (psutil), the
moments the test last saw the kernel (or its job in squeue) and first saw it gone, and Slurm's
own StartTime/EndTime of the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.remote.cluster import processes_with
from tests.waiting import wait_for
from workbench.cli import run as cli

# docs/kernels.md, "A client that is gone": the kernels here are installed with --orphan-after
# 10s, so each ends within 25 s of its client (45 s is the bound of the default 30 s), and not
# before 10 s after the client's last beat (beats come every 5 s, so at least 5 s after the kill).
ORPHAN_S = 10.0
BOUND_S = ORPHAN_S + 15.0
EARLIEST_S = ORPHAN_S - 5.0
MARGIN_S = 30.0  # a loaded two-core test box: the run's own commands are slow too
SLURM_CLOCK_S = 1.0  # Slurm records whole seconds

CLIENT = textwrap.dedent("""
    import sys, threading
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name=sys.argv[1])
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    reply = kc.execute_interactive("print(6 * 7)", timeout=120)
    assert reply["content"]["status"] == "ok", reply
    with open(sys.argv[2] + ".tmp", "w") as fh:
        fh.write(km.kernel_id)
    import os
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    threading.Event().wait()  # a client that holds its kernel until it is killed
""")


@pytest.fixture(scope="module")
def jupyter_data(targets, tmp_path_factory) -> Iterator[Path]:
    """A private Jupyter data folder for the kernelspecs (the clients inherit it)."""
    data = tmp_path_factory.mktemp("jupyter-data")
    old = os.environ.get("JUPYTER_DATA_DIR")
    os.environ["JUPYTER_DATA_DIR"] = str(data)
    try:
        yield data
    finally:
        if old is None:
            os.environ.pop("JUPYTER_DATA_DIR", None)
        else:
            os.environ["JUPYTER_DATA_DIR"] = old


def _start_client(kernel: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The client process and the id of the kernel it started (once a cell ran in it)."""
    out, err = tmp_path / "kernel-id", tmp_path / "client.err"
    with err.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, kernel, str(out)],
                                stdin=subprocess.DEVNULL, stdout=fh, stderr=fh)

    def started() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"the client exited ({proc.returncode}):\n"
                                 f"{err.read_text(errors='replace')[-3000:]}")
        return out.read_text() if out.exists() else None

    return proc, wait_for(started, 240, "the client to start its kernel and run a cell")


def _kill(proc: subprocess.Popen[bytes]) -> float:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return time.time()


class Watch:
    """When a condition was last seen true and first seen false."""

    def __init__(self, present) -> None:
        self.present, self.last_seen, self.gone_at = present, 0.0, 0.0

    def gone(self) -> bool:
        now = time.time()
        if self.present():
            self.last_seen = now
            return False
        self.gone_at = now
        return True


def _bill(kernel_id: str) -> dict:
    from workbench.targets.kernels.ledger import sessions

    (bill,) = [s for s in sessions() if s["kernel_id"] == kernel_id]
    return bill


def _runs(proc: psutil.Process) -> bool:
    """Whether the process still runs (a zombie waiting for its reaper has ended)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kernel_process(kernel_id: str) -> psutil.Process:
    (proc,) = [p for p in processes_with(kernel_id)
               if "workbench.targets.kernels.remote_kernel" in " ".join(p.cmdline())]
    return proc


def test_ssh_kernel_of_a_killed_client_ends_and_is_billed_its_life(jupyter_data, tmp_path):
    cli(["kernels", "install", "ssh:one", "--orphan-after", "10s"])
    client, kernel_id = _start_client("workbench-ssh-one", tmp_path)
    try:
        kernel = _kernel_process(kernel_id)
        started = kernel.create_time()  # from /proc, as the host saw the start
        assert _bill(kernel_id)["ended"] is None  # its client keeps the bill open
        killed = _kill(client)
        watch = Watch(lambda: _runs(kernel))
        wait_for(watch.gone, BOUND_S + MARGIN_S, "the kernel of the killed client to end")
        assert watch.gone_at - killed <= BOUND_S + 1, (killed, watch.gone_at)
        assert watch.last_seen >= killed + EARLIEST_S - 1  # on its own, its orphan time after
        wait_for(lambda: not processes_with(kernel_id), 30, "no process of the kernel left")
    finally:
        if client.poll() is None:
            _kill(client)
    bill = _bill(kernel_id)
    assert bill["ended"] is not None and "client ended" in bill["reason"], bill
    assert bill["started"] == pytest.approx(started, abs=1.0)
    assert watch.last_seen - 0.5 <= bill["ended"] <= watch.gone_at + 0.5, (bill, watch.__dict__)
    assert bill["billed_s"] == pytest.approx(bill["ended"] - bill["started"], abs=0.01)
    assert bill["billed_s"] >= watch.last_seen - started - 0.5  # every second it lived
    row = next(ln for ln in cli(["kernels", "list"]).splitlines()
               if ln.startswith("workbench-ssh-one "))
    held = re.findall(r"\d+:\d\d:\d\d", row)[-1]  # the HELD column
    assert _seconds(held) >= int(watch.last_seen - started)  # and `kernels list` shows it


def _seconds(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


def _slurm_times(job: str) -> dict[str, float]:
    """StartTime, EndTime and JobState of ``job`` as slurmctld reports them (accounting is off on
    the test cluster, so sacct has none)."""
    text = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                          text=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", text))
    return {"state": fields["JobState"], **{k: time.mktime(time.strptime(
        fields[k], "%Y-%m-%dT%H:%M:%S")) for k in ("StartTime", "EndTime")}}


def test_slurm_kernel_of_a_killed_client_releases_its_allocation(jupyter_data, cluster,
                                                                 tmp_path):
    cli(["kernels", "install", "slurm:login", "--gpus", "1", "--time", "10m",
         "--orphan-after", "10s"])
    client, kernel_id = _start_client("workbench-slurm-login", tmp_path)

    def job_state() -> str:
        return subprocess.run(["squeue", "-h", "-n", f"wb-kernel-{kernel_id}", "-o", "%i %T"],
                              capture_output=True, text=True).stdout.strip()

    try:
        job, state = job_state().split()
        assert state == "RUNNING"
        killed = _kill(client)
        watch = Watch(job_state)
        wait_for(watch.gone, BOUND_S + MARGIN_S, f"job {job} to leave the queue")
        assert watch.gone_at - killed <= BOUND_S + 1, (killed, watch.gone_at)
        assert watch.last_seen >= killed + EARLIEST_S - 1  # its orphan time after its client
        wait_for(lambda: not processes_with(kernel_id), 30, "no process of the kernel left")
    finally:
        if client.poll() is None:
            _kill(client)
    slurm = _slurm_times(job)
    assert slurm["state"] == "COMPLETED", slurm  # the kernel ended it, not the time limit
    assert slurm["EndTime"] - killed <= BOUND_S + SLURM_CLOCK_S
    bill = _bill(kernel_id)
    assert bill["job"] == job and "client ended" in bill["reason"], bill
    assert bill["started"] == pytest.approx(slurm["StartTime"], abs=SLURM_CLOCK_S)
    assert bill["ended"] >= slurm["EndTime"] - SLURM_CLOCK_S  # the whole allocation is billed
    assert watch.last_seen - SLURM_CLOCK_S <= bill["ended"] <= watch.gone_at + SLURM_CLOCK_S
    assert bill["billed_s"] == pytest.approx(bill["ended"] - bill["started"], abs=0.01)


def test_jupyter_run_shuts_its_kernel_down_at_exit(jupyter_data, tmp_path):
    # jupyter run shuts the kernel down from an atexit hook, when no new thread can start.
    cli(["kernels", "install", "ssh:one"])
    script = tmp_path / "cell.py"
    script.write_text("import os, time\nprint(os.environ['WORKBENCH_KERNEL_ID'], time.time())\n")
    res = subprocess.run([str(Path(sys.executable).parent / "jupyter-run"),
                          "--kernel=workbench-ssh-one", str(script)], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    exited = time.time()
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    kernel_id, ran = res.stdout.split()
    assert not processes_with(kernel_id)  # ended with its client, not left to its heartbeat
    bill = _bill(kernel_id)  # closed by the client itself, before it exited
    assert bill["ended"] is not None and "client ended" not in bill["reason"], bill
    assert float(ran) <= bill["ended"] <= exited
