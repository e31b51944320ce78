"""The test world for remote targets: a one-machine Slurm cluster and an sshd on loopback.

``python tests/remote/cluster.py up DIR`` (or the pytest fixtures in ``conftest.py``) starts
munged, slurmctld, slurmd (with two fake gres GPUs) and sshd, each in the foreground as a child
process, with every key, config, socket and spool file under DIR; ``down DIR`` kills the jobs
still there, waits for their slurmstepd processes to exit, and stops the daemons by the PIDs
recorded in DIR/pids.json. Nothing system-wide is touched, so it can run next to a real
installation. Requires the Debian packages slurm-wlm, munge and openssh-server (``make
remote-deps``) and root (slurmd, and a root sshd that lets the test key log in).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sshd")


@dataclass
class Cluster:
    """Where everything lives; ``env`` is what a client (sbatch, ssh) needs to use it."""

    root: Path
    node: str
    ssh_port: int
    ssh_config: Path
    known_hosts: Path
    identity: Path
    slurm_conf: Path
    pids: dict[str, int]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.slurm_conf)}


def _free_port(preferred: int | None = None) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _wait_for(what: str, check: object, timeout: float, logs: list[Path]) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs
                      if p.exists())
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s\n{tails}")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _spawn(argv: list[str], log: Path, user: str | None = None,
           env: dict[str, str] | None = None) -> int:
    # user= switches in the child itself (no runuser in between), so the PID is the daemon's.
    with log.open("ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, user=user, group=user,
                                extra_groups=[] if user else None)
    return proc.pid


def start_munge(root: Path) -> tuple[int, Path]:
    mdir = root / "munge"
    mdir.mkdir(mode=0o700)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge = pwd.getpwnam("munge")
    for p in (mdir, key):
        os.chown(p, munge.pw_uid, munge.pw_gid)
    sock = mdir / "munge.socket"
    pid = _spawn(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                  f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                  f"--log-file={mdir / 'munged.log'}"], root / "munged.out", user="munge")
    try:
        _wait_for("munged", sock.exists, 15, [root / "munged.out", mdir / "munged.log"])
    except RuntimeError:
        stop_pids({"munged": pid})
        raise
    return pid, sock


def write_slurm_conf(root: Path, node: str, munge_socket: Path) -> Path:
    gres_dir = root / "dev"
    gres_dir.mkdir()
    for i in range(2):  # gres wants character devices; these stand in for /dev/nvidiaN
        os.mknod(gres_dir / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
    (root / "state").mkdir()
    (root / "spool").mkdir()
    ctld, slurmd = _free_port(), _free_port()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=wbtest",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}",
        "SlurmUser=root",
        "MailProg=/bin/true",
        "MpiDefault=none",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket},cred_expire=10",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "DefMemPerCPU=512",
        "GresTypes=gpu",
        "SchedulerParameters=bf_interval=2,sched_interval=2",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobcomp.txt'}",
        # Time limits are enforced promptly and the kill follows the TERM quickly, so the
        # time-limit test costs about a minute, not three.
        "OverTimeLimit=0",
        "KillWait=5",
        "MinJobAge=600",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        # The box has 2 cores; declaring 8 lets a long test job wait next to a short one.
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 RealMemory=20000 Gres=gpu:2 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    (root / "gres.conf").write_text(f"Name=gpu File={gres_dir}/nvidia[0-1]\n")
    return conf


def start_slurm(root: Path, node: str, munge_socket: Path) -> tuple[dict[str, int], Path]:
    conf = write_slurm_conf(root, node, munge_socket)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids = {"slurmctld": _spawn(["slurmctld", "-D", "-i", "-f", str(conf)], root / "slurmctld.out",
                                env=env)}
    pids["slurmd"] = _spawn(["slurmd", "-D", "-f", str(conf), "-N", node], root / "slurmd.out",
                            env=env)

    def node_idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True,
                             text=True)
        return out.returncode == 0 and out.stdout.strip().startswith(("idle", "mixed"))

    try:
        _wait_for("slurm (node idle)", node_idle, 30,
                  [root / "slurmctld.out", root / "slurmd.out", root / "slurmctld.log",
                   root / "slurmd.log"])
    except RuntimeError:
        stop_pids(pids)
        raise
    return pids, conf


def start_sshd(root: Path) -> tuple[int, int, Path, Path, Path]:
    sdir = root / "ssh"
    sdir.mkdir()
    host_key, user_key = sdir / "host_ed25519", sdir / "id_ed25519"
    for key in (host_key, user_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    auth = sdir / "authorized_keys"
    shutil.copy(user_key.with_suffix(".pub"), auth)
    port = _free_port(2222)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    config = sdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {sdir}/sshd.pid",
        f"AuthorizedKeysFile {auth}", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password", "AcceptEnv LANG",
        "",
    ]))
    pid = _spawn(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], root / "sshd.out")
    try:
        _wait_for("sshd", lambda: _port_open(port), 15, [root / "sshd.out"])
    except RuntimeError:
        stop_pids({"sshd": pid})
        raise
    known = sdir / "known_hosts"
    pub = host_key.with_suffix(".pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
    client = sdir / "ssh_config"
    # Two aliases for the same loopback sshd stand in for two machines.
    client.write_text("".join(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User root\n"
        f"  IdentityFile {user_key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n"
        for alias in ("wb-node0", "wb-node1")))
    return pid, port, client, known, user_key


def up(root: Path) -> Cluster:
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # munged runs as the munge user and must reach its own folder
    node = socket.gethostname().split(".")[0]
    pids: dict[str, int] = {}
    try:
        pids["munged"], sock = start_munge(root)
        more, conf = start_slurm(root, node, sock)
        pids.update(more)
        pids["sshd"], port, client, known, key = start_sshd(root)
    except BaseException:
        stop_pids(pids)
        raise
    cluster = Cluster(root, node, port, client, known, key, conf, pids)
    (root / "pids.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                for k, v in asdict(cluster).items()}))
    return cluster


def stop_pids(pids: dict[str, int], timeout: float = 10.0) -> None:
    # Reverse start order: clients of munge first, munge last.
    for name in reversed(list(pids)):
        try:
            os.kill(pids[name], signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.time() + timeout
    for name in reversed(list(pids)):
        while time.time() < deadline:
            try:
                done, _ = os.waitpid(pids[name], os.WNOHANG)
            except ChildProcessError:  # not our child (``down`` from another process)
                try:
                    os.kill(pids[name], 0)
                    done = 0
                except ProcessLookupError:
                    done = pids[name]
            if done:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pids[name], signal.SIGKILL)
                os.waitpid(pids[name], 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def step_daemons(root: Path) -> list:
    """The cluster's live slurmstepd processes: each holds the cluster's slurmd log open."""
    import psutil

    log = str(root / "slurmd.log")
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "slurmstepd" and p.status() != psutil.STATUS_ZOMBIE and any(
                    f.path == log for f in p.open_files()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def end_jobs(root: Path, slurm_conf: Path, timeout: float = 30.0) -> None:
    """Kill every job of the cluster and wait until their slurmstepd processes have exited: a
    slurmd told to stop while a step still reports its end does not exit on SIGTERM, and that
    step stays behind."""
    import psutil

    subprocess.run(["scancel", "--user=root", "--signal=KILL", "--full"], capture_output=True,
                   env={**os.environ, "SLURM_CONF": str(slurm_conf)})
    psutil.wait_procs(step_daemons(root), timeout=timeout)


def kill_steps(root: Path) -> None:
    """SIGKILL the cluster's slurmstepd processes that are still there, with what they run."""
    import psutil

    procs = step_daemons(root)
    for p in list(procs):
        try:
            procs.extend(p.children(recursive=True))
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def down(root: Path) -> None:
    """Jobs first (their steps report to slurmd), then the daemons, then any step left."""
    saved = json.loads((root / "pids.json").read_text())
    end_jobs(root, Path(saved["slurm_conf"]))
    stop_pids(saved["pids"])
    kill_steps(root)


# What the tests look for once a run or an endpoint has ended: nothing of it may remain.

def processes_with(text: str) -> list:
    """Live (not zombie) processes on this machine whose command line contains ``text``."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(
                    p.info["cmdline"] or []):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def squeue_job_names() -> list[str]:
    """Names of the jobs in the queue (pending or running)."""
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True)
    return out.stdout.split()


if __name__ == "__main__":
    cmd, where = sys.argv[1], Path(sys.argv[2])
    if cmd == "up":
        c = up(where)
        print(json.dumps({"pids": c.pids, "ssh_port": c.ssh_port, "SLURM_CONF": str(c.slurm_conf)}))
    elif cmd == "down":
        down(where)
    else:
        sys.exit("usage: cluster.py up|down DIR")
