"""Shared plumbing of the remote backends: copy a run directory to a host, and read its files
incrementally back into the local run directory.

Commands run on a host through a :class:`~workbench.targets.backends.transport.Transport`
(re-exported here: ``SSHTransport``, ``LocalTransport``). :func:`sync_run_dir` mirrors what readers
need (status.json, metrics.jsonl, logs/) from the remote run directory into the local one with byte
offsets, in one round trip, so the Job handle, widgets and CLI read local files on every backend.
"""

from __future__ import annotations

import base64
import json
import shlex
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.runs.rundir import CANCEL_REQUESTED, RunDir, write_json_atomic
from workbench.targets.backends.transport import (  # noqa: F401  (re-exported)
    LocalTransport,
    Result,
    SSHTransport,
    Transport,
    ssh_option_value,
)
from workbench.targets.named import TargetError
from workbench.targets.secrets import remote_quote

# The remote run directory is authoritative for these; the local copy is a mirror.
MIRRORED = ("status.json", "metrics.jsonl", "eval.jsonl")
MAX_CHUNK = 4 << 20  # bytes per file per sync, so one poll never stalls on a huge log


def put_dir(transport: Transport, local: Path, parent: str, run_dir: bool = False) -> None:
    """Copy the folder ``local`` into ``parent`` on the transport's host (tar over the pipe).

    ``run_dir``: ``local`` is a run directory's local side, whose mirrored files (status.json,
    metrics.jsonl, logs/) stay behind: on a resume the remote copies are the originals and the
    local ones may lag behind them. :func:`write_remote_status` sets what a new attempt needs in
    the remote status.json.
    """
    where = shell_path(parent)
    transport.run(f"mkdir -p {where} && tar -C {where} -xf -", input=_tar_bytes(local, run_dir),
                  timeout=600)


def get_dir(transport: Transport, remote: str, local_parent: Path) -> None:
    """Copy the remote folder ``remote`` into ``local_parent`` (e.g. a finished adapter)."""
    parent, name = remote.rstrip("/").rsplit("/", 1)
    res = transport.run(f"tar -C {shell_path(parent)} -cf - {shlex.quote(name)}", timeout=600)
    _untar(res.stdout, local_parent)


def _tar_bytes(folder: Path, run_dir: bool) -> bytes:
    import io

    buf = io.BytesIO()
    def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = ti.name.split("/", 1)[1] if "/" in ti.name else ""
        if rel == "remote.json" or (run_dir and is_mirrored(rel) and not ti.isdir()):
            return None
        return ti

    with tarfile.open(fileobj=buf, mode="w") as tar:
        # Only what the run needs to start; the mirror files come back the other way.
        tar.add(folder, arcname=folder.name, filter=keep)
    return buf.getvalue()


def _untar(data: bytes, local_parent: Path) -> None:
    import io

    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(local_parent, filter="data")


# ``path`` quoted for a remote shell, with a leading ``~/`` still expanding there.
shell_path = remote_quote


# Merges fields into the remote status.json without workbench: atomically and under the status
# lock, as RunDir.update_status does, so a supervisor writing at the same moment loses nothing.
STATUS_SCRIPT = r"""
import fcntl, json, os, sys, time
d = os.path.expanduser(sys.argv[1])
p = os.path.join(d, "status.json")
req = json.loads(sys.stdin.read())
with open(os.path.join(d, ".status.lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with open(p) as fh:
            data = {**req["base"], **json.load(fh)}
    except (OSError, ValueError):
        data = req["base"]
    data.update(req["set"], updated=time.time())
    tmp = p + ".submit.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
"""


def write_remote_status(transport: Transport, remote_dir: str, python: str, local: Path,
                        **fields: Any) -> None:
    """A new attempt's status.json on the host: the remote copy where there is one (it knows the
    time billed so far and is ahead of the mirror), else the local one; then ``fields``."""
    request = {"base": RunDir(local).status(), "set": fields}
    transport.run(f"{shlex.quote(python)} -c {shlex.quote(STATUS_SCRIPT)} "
                  f"{shell_path(remote_dir)}", input=json.dumps(request).encode(), timeout=60)


def send_stop_request(transport: Transport, remote_dir: str, python: str, local: Path,
                      stop_request: str, what: str) -> None:
    """Record why a cancel is asked for (e.g. a sweep's "prune") in the remote status.json, where
    the run's supervisor reads it once its ranks have stopped, before the stop is sent. An
    unreachable host raises as an unconfirmed cancel: nothing was stopped."""
    try:
        write_remote_status(transport, remote_dir, python, local, stop_request=stop_request)
    except TargetError:
        raise unconfirmed_cancel(local, what, transport.where) from None
    RunDir(local).write_status(stop_request=stop_request)


def unconfirmed_cancel(local_dir: Path, what: str, where: str) -> TargetError:
    """The error for a cancel whose end could not be confirmed; the status says so meanwhile."""
    msg = (f"could not confirm that {what} stopped: {where} did not answer. The run may still be "
           "training and is not recorded as cancelled; cancel again once it is reachable "
           "(job.cancel()), and job.status() reports the state once it is known")
    RunDir(local_dir).write_status(warning=msg)
    return TargetError(msg)


# -- incremental mirroring --------------------------------------------------------------------

# Runs on the remote host (stdin: JSON request; stdout: JSON answer). Plain python3 is enough.
SYNC_SCRIPT = r"""
import base64, json, os, sys
req = json.load(sys.stdin)
d = os.path.expanduser(req["dir"])
out = {"files": {}, "alive": {}}
names = list(req["files"])
logs = os.path.join(d, "logs")
if os.path.isdir(logs):
    names += ["logs/" + n for n in sorted(os.listdir(logs)) if n.endswith((".log", ".out"))]
for rel in dict.fromkeys(names):
    off = req["files"].get(rel, req["offsets"].get(rel, 0))
    p = os.path.join(d, rel)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if off > size:
                off = 0  # replaced or truncated: read it again from the start
            fh.seek(off)
            data = fh.read() if rel == "status.json" else fh.read(req["max"])
    except OSError:
        continue
    out["files"][rel] = {"offset": off, "data": base64.b64encode(data).decode(), "size": size}
for pid in req["pids"]:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            out["alive"][str(pid)] = fh.read().split(") ")[-1][:1] != "Z"
    except (OSError, ProcessLookupError):
        out["alive"][str(pid)] = False
print("WORKBENCH-SYNC " + json.dumps(out))
"""


def sync_run_dir(transport: Transport, remote_dir: str, local_dir: Path, *, python: str = "python3",
                 prefix: str = "", pids: list[int] | None = None, chunk: int = MAX_CHUNK,
                 complete: bool = False) -> dict[str, bool]:
    """Bring new bytes of status.json, metrics.jsonl, eval.jsonl and logs/* into ``local_dir``.

    Offsets are the local files' sizes, so the mirror needs no bookkeeping and survives a
    kernel restart. ``prefix`` names the logs of a node other than 0 (``node-1-``), whose run
    directory may be a different folder on a different host. One round trip brings at most
    ``chunk`` bytes per file; ``complete`` asks again until every file is fetched to its end
    (before a run's mirror is frozen). Returns which ``pids`` are alive.
    """
    while True:
        alive, behind = _sync_once(transport, remote_dir, Path(local_dir), python, prefix,
                                   pids or [], chunk)
        if not (complete and behind):
            return alive


def _sync_once(transport: Transport, remote_dir: str, local_dir: Path, python: str, prefix: str,
               pids: list[int], chunk: int) -> tuple[dict[str, bool], bool]:
    (local_dir / "logs").mkdir(parents=True, exist_ok=True)
    files: dict[str, int] = {} if prefix else {
        "status.json": 0, "metrics.jsonl": _size(local_dir / "metrics.jsonl"),
        "eval.jsonl": _size(local_dir / "eval.jsonl")}
    offsets = {}
    logs = local_dir / "logs"
    for p in logs.iterdir():
        if p.name.startswith(prefix) and (prefix or not p.name.startswith("node-")):
            offsets[f"logs/{p.name[len(prefix):]}"] = p.stat().st_size
    req = {"dir": remote_dir, "files": files, "offsets": offsets, "max": chunk, "pids": pids}
    res = transport.run(f"{shlex.quote(python)} -c {shlex.quote(SYNC_SCRIPT)}",
                        input=json.dumps(req).encode(), check=False, timeout=60)
    line = next((ln for ln in res.stdout.decode(errors="replace").splitlines()
                 if ln.startswith("WORKBENCH-SYNC ")), None)
    if line is None:
        raise TargetError(f"could not read the run directory {remote_dir} on {transport.where}: "
                          f"{res.text or 'no answer'}")
    answer = json.loads(line.split(" ", 1)[1])
    behind = False
    for rel, item in answer["files"].items():
        data = base64.b64decode(item["data"])
        behind = behind or item["offset"] + len(data) < item.get("size", 0)
        if rel == "status.json":
            if data:
                try:
                    RunDir(local_dir).update_status(_mirror_of(json.loads(data)))
                except json.JSONDecodeError:
                    pass  # cannot happen with an atomic writer; keep the last good copy
            continue
        dest = local_dir / (f"logs/{prefix}{rel[5:]}" if rel.startswith("logs/") else rel)
        if not data and dest.exists():
            continue
        mode = "r+b" if dest.exists() else "wb"
        with dest.open(mode) as fh:
            fh.seek(item["offset"])
            fh.write(data)
            fh.truncate()
    return {k: bool(v) for k, v in answer["alive"].items()}, behind


def _mirror_of(remote: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """The change that makes the local status.json the remote one, except for a cancel request:
    it is recorded where the cancel was asked for (here), and no copy of the host's may drop it."""
    def mirror(local: dict[str, Any]) -> None:
        asked = local.get(CANCEL_REQUESTED)
        local.clear()
        local.update(remote)
        if asked is not None:
            local.setdefault(CANCEL_REQUESTED, asked)

    return mirror


def read_remote(transport: Transport, remote_dir: str, path: str, offset: int,
                python: str = "python3") -> bytes:
    """Bytes of one remote run-directory file from ``offset`` (empty if it does not exist)."""
    if Path(path).is_absolute() or ".." in Path(path).parts:
        raise TargetError(f"{path!r} is outside the run directory")
    script = ("import os,sys\np=os.path.join(os.path.expanduser(sys.argv[1]),sys.argv[2])\n"
              "try:\n f=open(p,'rb')\nexcept OSError:\n sys.exit(0)\n"
              "f.seek(int(sys.argv[3]));sys.stdout.buffer.write(f.read())\n")
    res = transport.run(f"{shlex.quote(python)} -c {shlex.quote(script)} {shlex.quote(remote_dir)} "
                        f"{shlex.quote(path)} {int(offset)}", check=True, timeout=120)
    return res.stdout


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


# -- the local record of where a run went -----------------------------------------------------

def save_placement(local_dir: Path, **fields: Any) -> dict[str, Any]:
    """remote.json in the LOCAL run dir: target, hosts, remote paths, PIDs or Slurm job id."""
    path = Path(local_dir) / "remote.json"
    data = load_placement(local_dir)
    data.update(fields, updated=time.time())
    write_json_atomic(path, data)
    return data


def load_placement(local_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(local_dir) / "remote.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def on_first_host(target: Any, node0: dict[str, Any], module: str) -> tuple[SSHTransport, str]:
    """(transport, command) that run ``python -m MODULE DIR`` in the run directory of a run's
    first host (``node0``: remote.json's first node), where rank 0 wrote the weights, with the
    target's environment and secrets (``job.evaluate``, ``job.export`` on an SSH run)."""
    transport = SSHTransport(target.hosts[node0["rank"]], target)
    q = shell_path(node0["dir"])
    return transport, (f"{target.remote_shell_prefix(transport, node0['dir'])}cd {q} && "
                       f"{shlex.quote(target.python)} -m {module} {q}")


# -- what the SSH and Slurm backends share -----------------------------------------------------

class MirroredRunDir:
    """The local side of a remote run: a mirror that stops syncing once the outcome is final.

    ``final`` in remote.json freezes the local status.json: after a backend decided how the run
    ended (e.g. Slurm says TIMEOUT), a later sync must not overwrite that with the remote file.
    """

    def __init__(self, local_dir: Path) -> None:
        self.path = Path(local_dir)

    @property
    def placement(self) -> dict[str, Any]:
        return load_placement(self.path)

    @property
    def final(self) -> bool:
        return bool(self.placement.get("final"))

    def finish(self, **status: Any) -> dict[str, Any]:
        from workbench.runs.rundir import RunDir

        out = RunDir(self.path).write_status(**status)
        save_placement(self.path, final=True)
        return out

    def fetch_artefact(self, transport: Transport, remote_dir: str) -> None:
        """Copy adapter/ (or model/) back once the run succeeded, so deploy and infer find it."""
        placement = self.placement
        if placement.get("artefact_fetched"):
            return
        for name in ("adapter", "model"):
            res = transport.run(f"test -d {shell_path(remote_dir)}/{name}", check=False)
            if res.returncode == 0:
                get_dir(transport, f"{remote_dir}/{name}", self.path)
                break
        save_placement(self.path, artefact_fetched=True)

    def read_local(self, path: str, offset: int) -> bytes:
        return RunDir(self.path).read_from(path, offset)

    def log_texts(self) -> dict[str, str]:
        logs = self.path / "logs"
        return {p.name: p.read_text(encoding="utf-8", errors="replace")
                for p in sorted(logs.glob("*")) if p.is_file()} if logs.is_dir() else {}


def is_mirrored(path: str) -> bool:
    return path in MIRRORED or path.startswith("logs/")
