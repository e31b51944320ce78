"""Local endpoints lease their GPU like runs do, and size vLLM's memory by what the card has free.

There is no GPU here: the two CUDA device ids come from CUDA_VISIBLE_DEVICES and `nvidia-smi` is a
stand-in script that reports a card with 20 GiB of 80 GiB in use (a mock, because the GPU cannot
run here; it says so). Everything else is real: the guard processes, their leases under
WORKBENCH_HOME and the server command each guard starts (a Python that prints what it was given).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.serve.server import guard_command

NVIDIA_SMI = """#!/bin/sh
# Stand-in for nvidia-smi (no GPU on this machine): memory.used, memory.total in MiB.
echo "20480, 81920"
"""

# The "server": reports the cards and the arguments it got, then waits until the test says go.
SERVER = ("import json, os, sys, time, pathlib; d = pathlib.Path(sys.argv[1]); "
          "(d / 'seen.json').write_text(json.dumps({'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'),"
          " 'argv': sys.argv[2:]})); "
          "[time.sleep(0.05) for _ in iter(lambda: (d / 'go').exists(), True)]")


@pytest.fixture
def gpu_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1"}


def _guard(folder: Path, env: dict, extra: list[str] = ()) -> subprocess.Popen:
    folder.mkdir(parents=True)
    cmd = guard_command(sys.executable, str(folder), "127.0.0.1", 0, "",
                        [sys.executable, "-c", SERVER, str(folder), *extra], gpus=1)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(path: Path, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_two_local_endpoints_get_different_cards_and_a_third_is_told_who_holds_them(tmp_path,
                                                                                    gpu_env):
    a, b, c = (tmp_path / "endpoints" / n for n in ("ep-a", "ep-b", "ep-c"))
    guards = [_guard(a, gpu_env)]
    seen_a = _wait_for(a / "seen.json")
    guards.append(_guard(b, gpu_env))
    seen_b = _wait_for(b / "seen.json")
    try:
        assert {seen_a["cuda"], seen_b["cuda"]} == {"0", "1"}
        third = _guard(c, gpu_env)
        out = third.communicate(timeout=120)[0].decode()
        assert third.returncode != 0 and not (c / "seen.json").exists()  # no server started
        assert "endpoint:ep-a" in out and "endpoint:ep-b" in out, out
        assert "no free GPU" in json.loads((c / "exit.json").read_text())["reason"]
    finally:
        for folder in (a, b):
            (folder / "go").touch()
        for g in guards:
            g.wait(120)
    # Ended guards gave their cards back: a new endpoint gets one.
    d = tmp_path / "endpoints" / "ep-d"
    guard = _guard(d, gpu_env)
    assert _wait_for(d / "seen.json")["cuda"] in ("0", "1")
    (d / "go").touch()
    guard.wait(120)


def test_vllm_gets_only_the_memory_the_card_has_free(tmp_path, gpu_env):
    e = tmp_path / "endpoints" / "ep-mem"
    guard = _guard(e, gpu_env)
    argv = _wait_for(e / "seen.json")["argv"]
    (e / "go").touch()
    guard.wait(120)
    fraction = float(argv[argv.index("--gpu-memory-utilization") + 1])
    # The stand-in card has 60 of 80 GiB free: vLLM's default 0.9 would not start beside the
    # 20 GiB another process holds; what it gets must fit in what is free, leaving some room.
    assert 0.6 < fraction < 0.75
    # A fraction the user passed stays theirs.
    f = tmp_path / "endpoints" / "ep-own"
    guard = _guard(f, gpu_env, ["--gpu-memory-utilization", "0.5"])
    argv = _wait_for(f / "seen.json")["argv"]
    (f / "go").touch()
    guard.wait(120)
    assert argv.count("--gpu-memory-utilization") == 1 and "0.5" in argv
