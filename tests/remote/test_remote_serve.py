"""Serving on remote targets with real vLLM on CPU: an SSH host (through a tunnel) and a Slurm job.

The "SSH host" is the loopback sshd of ``tests/remote/cluster.py`` with its own working folder,
and the Slurm cluster is the one-machine cluster there; vLLM is the real ``.venv-serve`` one
(``serve_python`` of the targets). A run trained here is served on each target and its greedy
replies are compared with transformers + peft (the run is the one tests/test_serve.py serves
locally, trained once per session). The SSH endpoint is also metered by a course's
:class:`~workbench.course.endpoints.EndpointMeter` while it runs (no vLLM of its own): its
/metrics read through the serve target, its final charge from the guard's exit.json on the host.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import workbench
from tests.remote.cluster import processes_with, squeue_job_names
from workbench.assets.teaching import teaching_rows
from workbench.course.config import Course
from workbench.course.desk import CourseDesk
from workbench.course.endpoints import EndpointMeter
from workbench.runs.ledger import Ledger
from workbench.serve import DeployError, ServingEnvironmentError, deploy, get_endpoint
from workbench.serve.remote import close_tunnel

pytestmark = pytest.mark.slow
PROMPTS = [r["instruction"] for r in teaching_rows("heldout")][:12]


def _gone(text: str, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and processes_with(text):
        time.sleep(0.3)
    return not processes_with(text)


def _course_meter(root: Path, serve_target: str) -> EndpointMeter:
    """The meter of a course whose endpoints are served on ``serve_target``; an endpoint costs
    36 CNY an hour there, 1 fen a second, held in one-hour blocks; idle after one minute."""
    course = Course.model_validate({
        "name": "remote-serve", "instructors": ["teacher"], "students": ["ana"],
        "default_credit": 100, "targets": ["local", serve_target], "serve_target": serve_target,
        "prices": {"endpoint_hour": 36}, "endpoint_hold_minutes": 60, "idle_minutes": 1,
        "state_dir": str(root / "course-state")})
    desk = CourseDesk(course, Ledger(f"sqlite:///{root / 'ledger.sqlite'}"))
    desk.open_accounts()
    return EndpointMeter(desk)


@pytest.fixture(scope="module")
def trained(targets, served_run):
    return served_run  # tests/conftest.py: the run tests/test_serve.py serves locally


@pytest.fixture(scope="module")
def slurm_ep(trained, targets):
    """The Slurm endpoint, submitted before the SSH test runs so the two vLLM start-ups overlap
    (each is tens of seconds); its own test waits for it to answer. Stopped here if that test
    did not get to stop it."""
    ep = deploy(trained, target="slurm:local", name="slurm-ep", wait=False, progress=False)
    try:
        yield ep
    finally:
        if get_endpoint("slurm-ep").record.state != "stopped":
            ep.stop()


@pytest.fixture(scope="module")
def reference(trained) -> list[str]:
    from workbench.serve.infer import load_chat_model

    return load_chat_model(trained).generate(PROMPTS)


def test_ssh_endpoint_is_reached_through_a_tunnel_and_dies_with_its_kernel(trained, reference,
                                                                           targets, slurm_ep,
                                                                           tmp_path):
    # slurm_ep: the Slurm endpoint starts alongside (the next test checks it).
    # The deploying "kernel" is a child process: it deploys with keep=False, then is killed -9.
    kernel = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, workbench\n"
         f"ep = workbench.deploy({trained.id!r}, target='ssh:one', name='ssh-ep', progress=False)\n"
         "print('READY', ep.url, flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ)
    try:
        line = kernel.stdout.readline()
        assert line.startswith("READY http://127.0.0.1:"), kernel.stderr.read()[-3000:]
        # Another process (a restarted kernel, the lab panel) finds it and opens its own tunnel.
        ep = get_endpoint("ssh-ep")
        assert ep.state == "healthy" and ep.target == "ssh:one"
        assert ep.listen_url.startswith("http://wb-node0:")
        assert ep.url.startswith("http://127.0.0.1:") and ep.url != line.split()[1]
        own_forward = f"-L 127.0.0.1:{ep.url.rsplit(':', 1)[1]}:"  # this process's tunnel
        server_dir = f"{targets['ssh']['one']['workdir']}/endpoints/ssh-ep"
        # The adapter was copied to the host; the base model path existed there and is used as is.
        adapter_path = ep.serves["adapters"][trained.spec.name]
        assert adapter_path.startswith(server_dir) and Path(adapter_path, "adapter_config.json").is_file()
        # A course meters it as ana's (the rows its deploy writes: one block held since now).
        meter = _course_meter(tmp_path, "ssh:one")
        since = time.time()
        block = meter.ledger.hold("ana", 3600, actor="ana", note="deploy ssh-ep")
        meter.ledger.attach_run(block, "ssh-ep", ep.record.endpoint_dir, kind="endpoint",
                                since=since)
        assert meter.tick(now=since + 5) == []  # its first look at the requests done
        assert ep.generate(PROMPTS) == reference
        assert meter.tick(now=since + 50) == []  # saw those requests: busy at since + 50
        # Idle 50 s of the course's 60: up. Its listen URL (wb-node0) does not resolve here: a
        # meter that read /metrics there would count idle from its first look (95 s), and stop it.
        assert meter.tick(now=since + 100) == [] and ep.state == "healthy"
        # What the service tells the student is where the hub machine reaches it (the tunnel).
        assert meter.view("ssh-ep")["url"] == ep.url
        server = processes_with(f"{server_dir}/chat_template.jinja")
        assert server, "no vLLM process runs from the endpoint's folder on the host"
    finally:
        kernel.send_signal(signal.SIGKILL)  # the kernel dies without cleaning anything up
        kernel.wait()
    # Its ssh session's stdin closes with it; the guard on the host stops vLLM.
    assert _gone(server_dir), [p.cmdline() for p in processes_with(server_dir)]
    # Its tunnel ends with it too; the tunnel this process opened stays until it is closed.
    kernel_forward = f"-L 127.0.0.1:{line.split()[1].rsplit(':', 1)[1]}:"
    assert _gone(kernel_forward), [p.cmdline() for p in processes_with(kernel_forward)]
    assert processes_with(own_forward)
    close_tunnel(ep.record.endpoint_dir)
    assert not processes_with(own_forward)
    ended = json.loads(Path(server_dir, "exit.json").read_text())
    assert ended["reason"] == "watched process ended"
    assert get_endpoint("ssh-ep").record.state == "stopped"
    # The meter finds it gone and charges its block until the exit the guard recorded on the
    # host (1 fen a second). It looks 3 s after that exit: a meter that charged until its own
    # look (the exit.json it cannot find locally) would charge those 3 s more.
    while time.time() < float(ended["time"]) + 3:
        time.sleep(0.2)
    assert meter.tick() == ["ssh-ep"]
    [charge] = [e for e in meter.ledger.entries("ana") if e["kind"] == "charge"]
    assert charge["hold_id"] == block
    assert abs(charge["amount"] - math.ceil(float(ended["time"]) - since)) <= 1
    assert meter.ledger.account("ana").held == 0


def test_slurm_endpoint_runs_inside_its_job_with_an_api_key(slurm_ep, reference, targets):
    ep = slurm_ep
    try:
        ep.wait_healthy(timeout=400, progress=False)
        script = (ep.dir / "serve.sbatch").read_text()
        assert "#SBATCH --time=00:10:00" in script and "#SBATCH --no-requeue" in script
        assert "wb-serve-slurm-ep" in squeue_job_names()
        assert "VLLM_API_KEY" not in script and ep.api_key  # on every interface: a key, from a file
        # The address names the node Slurm put the job on (whatever this machine is called).
        node = subprocess.run(["squeue", "-h", "-o", "%N", "-n", "wb-serve-slurm-ep"],
                              capture_output=True, text=True).stdout.strip()
        assert node and ep.listen_url.startswith(f"http://{node}:") and ep.url == ep.listen_url
        denied = httpx.post(ep.api_base + "/chat/completions", json={"model": ep.model,
                            "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert denied.status_code == 401
        assert ep.generate(PROMPTS) == reference
        assert ep.logs(tail=None)  # the job's output is the server log
    finally:
        ep.stop()
    # scancel ended the job, and with it the server: nothing outlives the allocation.
    deadline = time.time() + 60
    while time.time() < deadline and "wb-serve-slurm-ep" in squeue_job_names():
        time.sleep(0.5)
    assert "wb-serve-slurm-ep" not in squeue_job_names()
    assert _gone(str(ep.dir)), [p.cmdline() for p in processes_with(str(ep.dir))]
    assert get_endpoint("slurm-ep").record.state == "stopped"


def test_remote_bad_inputs_are_clear_errors(trained, targets, tmp_path, monkeypatch):
    import workbench.course.endpoints as course_endpoints
    from workbench.serve.sources import plan_serving
    from workbench.targets.named import TargetError

    with pytest.raises(ServingEnvironmentError, match="on host wb-node0 has no vLLM installed"):
        deploy(trained, target="ssh:one", name="novllm-ep", python=sys.executable, progress=False)
    with pytest.raises(DeployError, match="(?s)cannot import workbench.*fix 'python:'"):
        deploy(trained, target="ssh:broken", name="broken-ep", progress=False)
    with pytest.raises(DeployError, match="cannot reach 127.0.0.1 over SSH"):
        deploy(trained, target="ssh:down", name="down-ep", progress=False)
    # A course serving on ssh:nowhere deploys there (the failure is that target's), and the block
    # it held comes back but for the seconds the deploy tried.
    meter = _course_meter(tmp_path, "ssh:nowhere")
    # "ana" has no Unix account here: the plan her worker would make (and the service's copies of
    # her files, tests/course/test_isolation.py) are the plan of the run itself.
    monkeypatch.setattr(course_endpoints, "student_plan",
                        lambda course, student, runs: plan_serving([trained]))
    monkeypatch.setattr(course_endpoints, "copies", lambda course, student, plan, dest: plan)
    meter.ledger.attach_run(meter.ledger.hold("ana", 1, actor="ana", note="launch"), trained.id,
                            str(trained.run_dir.path))  # the run is ana's in this course
    with pytest.raises(TargetError, match="ssh:nowhere.*not configured"):
        meter.deploy("ana", [trained.id], name="nowhere-ep")
    [block] = [h for h in meter.ledger.holds("ana") if h.kind == "endpoint"]
    assert block.run_id == "nowhere-ep.ana" and block.charge is not None
    assert block.charge < block.amount and meter.ledger.account("ana").held == 1
    with pytest.raises(TargetError, match="not configured"):
        deploy(trained, target="ssh:nowhere", name="nowhere-ep", progress=False)
    assert not [e for e in workbench.serve.endpoints(all=True) if e.name.endswith("-ep")
                and e.name in ("novllm-ep", "broken-ep", "down-ep", "nowhere-ep",
                               "nowhere-ep.ana")]
