"""Registry under concurrent writers; run-directory status and metrics reading."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from workbench.errors import RunNotFoundError
from workbench.runs.registry import Registry, RunRecord
from workbench.runs.rundir import MetricsReader, RunDir, write_text_atomic
from workbench.spec import RunSpec


def _record(run_id: str, name: str = "r", created: float | None = None) -> RunRecord:
    now = created or time.time()
    return RunRecord(id=run_id, name=name, target="local", backend_job_id=None,
                     run_dir=f"/tmp/{run_id}", state="pending", created=now, updated=now)


def _writer(path: str, worker: int, n: int) -> None:
    reg = Registry(path)
    for i in range(n):
        reg.add_run(_record(f"w{worker}-{i}", name=f"w{worker}"))
        reg.update_run(f"w{worker}-{i}", state="running", backend_job_id=f"local:{i}")
        reg.list_runs(limit=5)


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "reg.sqlite")
    Registry(path)
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, w, 40))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    runs = Registry(path).list_runs()
    assert len(runs) == 160
    assert {r.state for r in runs} == {"running"}


def _rewrite(path: str, n: int) -> None:
    for i in range(n):
        write_text_atomic(Path(path), str(100000 + i))


def test_a_polling_reader_never_sees_an_empty_or_partial_file(tmp_path):
    """The serving guard's pid and address files are read by another process as soon as they
    exist; a plain write_text let that reader see an empty file (CI: int('') in deploy)."""
    path = tmp_path / "server.pid"
    writer = mp.get_context("spawn").Process(target=_rewrite, args=(str(path), 3000))
    writer.start()
    seen = set()
    while writer.is_alive() or not seen:
        try:
            seen.add(path.read_text())
        except FileNotFoundError:
            continue
    writer.join(60)
    assert writer.exitcode == 0
    assert all(len(text) == 6 and text.isdigit() for text in seen), sorted(seen)[:5]
    assert path.read_text() == "102999" and len(seen) > 1
    assert [p.name for p in tmp_path.iterdir()] == ["server.pid"]  # no temporary file left


def test_lookup_by_id_name_and_prefix(registry):
    registry.add_run(_record("alpha-20260101-000000-aaaa", "alpha", created=1.0))
    registry.add_run(_record("alpha-20260102-000000-bbbb", "alpha", created=2.0))
    registry.add_run(_record("beta_1-x", "beta_1", created=3.0))
    assert registry.get_run("alpha").id.endswith("bbbb")  # the newest of that name
    assert registry.get_run("alpha-20260101").id.endswith("aaaa")  # unique prefix
    assert registry.get_run("beta_1-x").name == "beta_1"
    with pytest.raises(RunNotFoundError, match="workbench status"):
        registry.get_run("alpha-2026")  # ambiguous prefix is not a match
    with pytest.raises(RunNotFoundError):
        registry.get_run("beta%")  # LIKE wildcards are escaped
    with pytest.raises(ValueError, match="cannot update"):
        registry.update_run("beta_1-x", name="other")


def test_metrics_reader_tolerates_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    reader = MetricsReader(path)
    assert reader.read_new() == []  # no file yet
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert reader.read_new() == [{"step": 1, "loss": 2.0}]
    assert reader.read_new() == []  # the half line is not consumed...
    with path.open("a") as fh:
        fh.write('ss": 1.5}\n{"step": 3, "loss": 1.0}\n')
    assert reader.read_new() == [{"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]


def test_metrics_reader_skips_a_torn_line_followed_by_others(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    assert [m["step"] for m in MetricsReader(path).read_new()] == [1, 3]


def test_status_is_replaced_atomically(tmp_path):
    rd = RunDir(tmp_path / "run").create(RunSpec())
    assert rd.status()["state"] == "pending"
    rd.write_status(state="running", step=3)
    rd.write_status(step=4)
    status = json.loads(rd.status_file.read_text())
    assert status["state"] == "running" and status["step"] == 4
    assert not list(rd.path.glob(".status.json.*"))  # no temp files left behind
    assert rd.spec() == RunSpec()
    with pytest.raises(FileExistsError):
        RunDir(tmp_path / "run").create(RunSpec())  # a run directory is written once


def test_backends_read_inside_the_run_directory_only(tmp_path):
    from workbench.runs.rundir import RunDirError
    from workbench.targets.backends.local import LocalBackend

    rd = RunDir(tmp_path / "run").create(RunSpec())
    rd.append_metrics({"step": 1, "loss": 2.0})
    (tmp_path / "secret.txt").write_text("not yours")
    backend = LocalBackend()
    whole = backend.read(rd.path, "metrics.jsonl")
    assert backend.read(rd.path, "metrics.jsonl", offset=5) == whole[5:]
    assert backend.read(rd.path, "logs/not-yet.log") == b""  # a file that is not written yet
    for escape in ("../secret.txt", "logs/../../secret.txt", str(tmp_path / "secret.txt")):
        with pytest.raises(RunDirError, match="outside the run directory"):
            backend.read(rd.path, escape)
