"""A target's secret env reaches the job, and nothing else: not the run directory, not the
printed sbatch script, not the error of a failed submit. Real sbatch on this machine (no
controller it can use here, or a partition that does not exist: the submit fails for real)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from workbench.runs.rundir import FAILED, RunDir
from workbench.spec import RunSpec
from workbench.targets.backends.slurm import SlurmBackend
from workbench.targets.named import SlurmTarget, TargetError
from workbench.targets.secrets import scrub, split_env, write_secret_env

SECRETS = {"HF_TOKEN": "hf_Zq8RkX3vLm2Tn9Wc4Yp7Hd1F",
           "WANDB_API_KEY": "0f1e2d3c4b5a69788796a5b4c3d2e1f0aa55",
           "DB_PASSWORD": "it's a $ecret \"quoted\" one"}  # shell-special: must survive quoting


def test_target_secrets_never_reach_the_run_directory_the_output_or_the_error(tmp_path, capsys):
    target = SlurmTarget(name="secretive", partition="wb-no-such-partition",
                         env={"HF_HOME": "/scratch/hf", **SECRETS})
    rd = RunDir(tmp_path / "runs" / "r-secret").create(RunSpec())
    with pytest.raises(TargetError) as refused:
        SlurmBackend(target.ref, target).submit(rd.path, rd.spec())
    printed = capsys.readouterr()
    status = rd.status()
    assert status["state"] == FAILED and status["error"]
    script = (rd.path / "slurm.sbatch").read_text()
    for value in SECRETS.values():
        assert value not in printed.out + printed.err
        assert value not in str(refused.value)
        for path in rd.path.rglob("*"):
            if path.is_file():
                assert value not in path.read_text(errors="replace"), path
    # What the script shows instead, and a plain variable as it was.
    assert "HF_TOKEN=*** WANDB_API_KEY=*** DB_PASSWORD=***" in script
    assert "export HF_HOME=/scratch/hf" in script
    assert "HF_TOKEN=***" in printed.out
    # The job sources the env file: owner-only, outside the run directory, holding every value.
    sourced = [ln[2:].strip() for ln in script.splitlines() if ln.startswith(". ")]
    assert len(sourced) == 1
    env_file = Path(sourced[0])
    assert env_file.is_file() and rd.path not in env_file.parents
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(env_file.parent.stat().st_mode) == 0o700
    seen = subprocess.run(["bash", "-c", 'set -eo pipefail; . "$0"; printf "%s\\n" '
                           '"$HF_TOKEN" "$WANDB_API_KEY" "$DB_PASSWORD"', str(env_file)],
                          capture_output=True, text=True, check=True)
    assert seen.stdout.splitlines() == list(SECRETS.values())


def test_a_target_without_secrets_writes_no_env_file(tmp_path, capsys):
    target = SlurmTarget(name="plain", partition="wb-no-such-partition",
                         env={"HF_HOME": "/scratch/hf"})
    rd = RunDir(tmp_path / "runs" / "r-plain").create(RunSpec())
    with pytest.raises(TargetError):
        SlurmBackend(target.ref, target).submit(rd.path, rd.spec())
    assert not (tmp_path / "runs" / ".secrets").exists()
    assert "\n. " not in (rd.path / "slurm.sbatch").read_text()


def test_what_counts_as_secret_by_name_or_by_shape():
    plain, secret = split_env({"HF_HOME": "/x", "MY_AUTH": "abc", "NOTE": "hf_abcdefghijklmnopqrstu",
                               "PATH_EXTRA": "/opt/bin", "AWS_SECRET_ACCESS_KEY": "k"})
    assert set(plain) == {"HF_HOME", "PATH_EXTRA"}
    assert set(secret) == {"MY_AUTH", "NOTE", "AWS_SECRET_ACCESS_KEY"}
    assert scrub("url https://h/?x=1 token: abc123 hf_abcdefghijklmnopqrstu", secrets=[]) == \
        "url https://h/?x=1 token: *** ***"


def test_a_served_endpoint_script_holds_no_secret_and_sources_them(tmp_path):
    # serve.sbatch is written into the endpoint folder and shown; the target's tokens and the
    # endpoint's own API key must stay in the owner-only file it sources.
    from workbench.serve.slurm import serve_sbatch_script

    target = SlurmTarget(name="served", partition="gpu", env={"HF_HOME": "/scratch/hf", **SECRETS})
    api_key = "wb-Hq3Lr8Zt2Vx7Nc5Km1Pd9Ws4"
    script = serve_sbatch_script(target, str(tmp_path / "endpoints" / "chat"), "wb-serve-chat",
                                 {"VLLM_API_KEY": api_key, "VLLM_CPU_KVCACHE_SPACE": "1"},
                                 ["python", "-m", "vllm.entrypoints.openai.api_server"], 1)
    for value in [*SECRETS.values(), api_key]:
        assert value not in script
    assert "export HF_HOME=/scratch/hf" in script and "export VLLM_CPU_KVCACHE_SPACE=1" in script
    sourced = [ln[2:].strip() for ln in script.splitlines() if ln.startswith(". ")]
    assert sourced and (tmp_path / "endpoints") in Path(sourced[0]).parents
    assert Path(sourced[0]).parent.name == ".secrets"
    assert "VLLM_API_KEY=***" in script


class _Recording:
    """A real shell (bash -c, as ssh runs it on the host) that keeps every command line it ran:
    what ``ps`` would show on either end of an ssh connection."""

    def __init__(self):
        from workbench.targets.backends.remote import LocalTransport

        self.inner, self.commands = LocalTransport(), []
        self.where = "this machine"

    def run(self, command, **kwargs):
        self.commands.append(command)
        return self.inner.run(command, **kwargs)


def test_ssh_commands_get_the_secrets_from_a_private_file_not_their_command_line(tmp_path):
    from workbench.targets.named import SSHTarget

    target = SSHTarget(name="box", hosts=[{"host": "localhost"}],
                       env={**SECRETS, "HF_HOME": "/scratch/hf"})
    tr = _Recording()
    prefix = target.remote_shell_prefix(tr, str(tmp_path / "runs" / "r1"), {"PORT": "8011"})
    out = tr.run(prefix + 'printf "%s|%s|%s|%s|%s" "$HF_TOKEN" "$WANDB_API_KEY" "$DB_PASSWORD" '
                          '"$HF_HOME" "$PORT"').stdout.decode()
    assert out.split("|") == [*SECRETS.values(), "/scratch/hf", "8011"]  # all reached the command
    for command in tr.commands:
        for value in SECRETS.values():
            assert value not in command
    env_file = tmp_path / "runs" / ".secrets" / "r1.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    # A `~/` place expands on the host, as the target's workdir does.
    home_place = target.remote_shell_prefix(tr, "~/.wb-secret-test/r2")
    try:
        assert str(Path.home() / ".wb-secret-test" / ".secrets" / "r2.env") in subprocess.run(
            ["bash", "-c", f"ls {Path.home()}/.wb-secret-test/.secrets/r2.env"],
            capture_output=True, text=True).stdout
        assert "$HOME" in home_place
    finally:
        subprocess.run(["rm", "-rf", str(Path.home() / ".wb-secret-test")])


@pytest.mark.parametrize(("slurm", "recorded", "ends"), [
    ("COMPLETED", "succeeded", "succeeded"), ("FAILED", "failed", "failed"),
    ("CANCELLED", "running", "cancelled"), ("COMPLETED", "budget_stopped", "budget_stopped"),
    ("TIMEOUT", "running", "failed"), ("NODE_FAIL", "running", "failed"),
])
def test_the_secret_env_file_stays_while_slurm_may_requeue_the_job_and_goes_at_its_end(
        tmp_path, monkeypatch, slurm, recorded, ends):
    from workbench.targets.backends.remote import LocalTransport, load_placement, save_placement

    target = SlurmTarget(name="secretive", partition="debug", env=SECRETS)
    backend = SlurmBackend(target.ref, target)
    rd = RunDir(tmp_path / "runs" / "r-ends").create(RunSpec())
    env_file = Path(write_secret_env(LocalTransport(), target.env, str(rd.path.resolve())))
    save_placement(rd.path, target=target.ref, kind="slurm", dir=None, job="42", final=False)
    # What `scontrol show job` says, in turn: the decision is the backend's, from Slurm's state
    # (tests/remote runs real Slurm jobs; this checks every ending without paying for each).
    said = {"JobState": "PENDING"}
    monkeypatch.setattr(backend, "job_info", lambda job: dict(said))
    # (Slurm's state, what status.json says, what the run shows): a requeue is queued again.
    for state, run_state, shown in (("PENDING", "queued", "queued"),
                                    ("RUNNING", "running", "running"),
                                    ("REQUEUED", "cancelled", "queued"),
                                    ("RUNNING", "running", "running")):
        said["JobState"] = state
        rd.write_status(state=run_state)
        assert backend.status(rd.path, "slurm:42")["state"] == shown, state
        assert env_file.is_file(), state  # a requeued attempt sources it again
    said["JobState"] = slurm
    rd.write_status(state=recorded)
    final = backend.status(rd.path, "slurm:42")
    assert final["state"] == ends
    assert load_placement(rd.path)["final"]
    assert not env_file.exists()
    assert env_file.parent.is_dir()  # other runs' files live there too
