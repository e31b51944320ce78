"""TensorBoard for a run when the port chosen for it is taken before TensorBoard binds it.

A real TensorBoard on real event files; the port race is made certain by holding the first port
offered (another process listening there), as happens when something grabs it in between.
The module is loaded from this checkout's extensions/ (the installed copy may be older).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import urllib.request
from pathlib import Path

import pytest

MODULE = Path(__file__).parents[2] / "extensions" / "workbench_lab" / "workbench_lab" / \
    "tensorboard.py"


@pytest.fixture
def tb():
    spec = importlib.util.spec_from_file_location("checkout_lab_tensorboard", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_taken_port_moves_tensorboard_to_another_and_never_to_the_stranger(tb, tmp_path,
                                                                             monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as writer:
        for step in range(1, 4):
            writer.add_scalar("train/loss", 4.0 / step, step)
    stranger = socket.socket()  # listens, accepts connections, never answers
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    taken = stranger.getsockname()[1]
    real, offered = tb._free_port, [taken]
    monkeypatch.setattr(tb, "_free_port", lambda: offered.pop() if offered else real())
    boards = tb.TensorBoards("/")
    try:
        path = boards.url("run-1", tmp_path / "tb", wait_s=120)
        port = boards.port("run-1")
        assert path == "/workbench/tensorboard/run-1/"
        assert port is not None and port != taken
        # The board that answers is TensorBoard with this run's events.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}data/runs", timeout=30) as r:
            assert json.loads(r.read()) == ["."]
    finally:
        boards.stop_all()
        stranger.close()
