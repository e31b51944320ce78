"""targets.yaml as people write it: a mistake in one entry, and YAML's own reading of values.

Nothing here reaches a host: the checks of a connection are in tests/remote/test_remote.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench
from workbench.cli import main
from workbench.errors import TargetError
from workbench.targets.backends.remote import SSHTransport
from workbench.targets.check import check_target
from workbench.targets.named import get_target, load_targets, target_names

TARGETS = """\
ssh:
  good:
    hosts: [gpu1]
  hosttypo:
    hosts: [{hots: gpu2}]
  notamapping: gpu3
slurm:
  typo:
    partiton: gpu
  fine:
    partition: gpu
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    return tmp_path


def test_a_mistake_in_one_target_entry_spares_the_others(home, capsys):
    (home / "targets.yaml").write_text(TARGETS)
    assert set(load_targets()) == {"ssh:good", "slurm:fine"}
    assert [h.host for h in get_target("ssh:good").hosts] == ["gpu1"]
    assert get_target("slurm:fine").partition == "gpu"
    # The broken ones are offered (launching one says what is wrong), after the good ones.
    assert target_names() == ["local", "ssh:good", "slurm:fine", "ssh:hosttypo",
                              "ssh:notamapping", "slurm:typo"]
    path = home / "targets.yaml"
    with pytest.raises(TargetError) as typo:
        get_target("slurm:typo")
    assert str(typo.value).startswith(
        f"{path}: slurm.typo: partiton: unknown field; did you mean 'partition'? allowed fields: ")
    with pytest.raises(TargetError, match=r"ssh\.hosttypo: .*hosts\.0\.hots: unknown field; did "
                                          r"you mean 'host'\? allowed fields: address, host, "
                                          r"port, user, workdir"):
        get_target("ssh:hosttypo")
    with pytest.raises(TargetError, match=r"ssh\.notamapping: expected a mapping of fields, got "
                                          r"'gpu3'"):
        get_target("ssh:notamapping")
    with pytest.raises(TargetError, match="did you mean 'partition'"):
        workbench.launch({"name": "typo", "target": "slurm:typo", "train": {"max_steps": 1}})
    # `targets check` reports it (no host is asked), and `targets list` flags it.
    report = check_target("slurm:typo")
    assert not report.ok and [c.name for c in report.checks] == ["targets.yaml entry"]
    assert "did you mean 'partition'" in report.checks[0].detail
    assert f"correct slurm.typo in {path}" in report.checks[0].fix
    assert main(["targets", "check", "slurm:typo"]) == 1
    assert "did you mean 'partition'" in capsys.readouterr().out
    assert main(["targets", "list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]
              if line.strip()}
    assert "gpu1" in listed["ssh:good"]
    assert "NOT USABLE: see `workbench targets check slurm:typo`" in listed["slurm:typo"]


def test_a_misspelt_section_is_refused_with_the_closest_one(home):
    (home / "targets.yaml").write_text("slurmm:\n  c: {partition: gpu}\n")
    with pytest.raises(TargetError, match=r"unknown section\(s\) \['slurmm'\] \(did you mean "
                                          r"'slurm'\?\); use 'ssh:' and 'slurm:'"):
        load_targets()


def test_ssh_options_written_as_numbers_and_yes_no_reach_ssh_as_it_reads_them(home):
    # YAML reads 2222 as a number and yes/no as booleans.
    (home / "targets.yaml").write_text(
        "ssh:\n  gw:\n    hosts: [gpu1]\n    ssh_options: {Port: 2222, ForwardAgent: no, "
        "Compression: yes, ProxyJump: bastion}\n")
    target = get_target("ssh:gw")
    argv = SSHTransport(target.hosts[0], target).ssh_argv()
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert options[-4:] == ["Port=2222", "ForwardAgent=no", "Compression=yes",
                            "ProxyJump=bastion"]
    assert argv[-1] == "gpu1"


@pytest.mark.parametrize("name, dist", [
    ("torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", ("torch", "2.13.0+cpu")),
    ("torch-2.13.0+cpu", ("torch", "2.13.0+cpu")),  # its dist-info folder, less .dist-info
    ("typing_extensions-4.12.2-py3-none-any.whl", ("typing-extensions", "4.12.2")),
    ("Jinja2-3.1.4", ("jinja2", "3.1.4")),
    ("zope.interface-7.0-cp311-cp311-manylinux_2_17_x86_64.whl", ("zope-interface", "7.0")),
])
def test_a_wheel_and_the_dist_info_it_installs_name_the_same_release(name, dist):
    """`targets setup` carries no wheel of a release the target's venv has (by these names)."""
    from workbench.targets.wheels import dist_key

    assert dist_key(name) == dist


def test_the_wheelhouse_resolves_again_when_what_it_resolves_from_changes(tmp_path):
    """A set-up again reuses the wheels an earlier one resolved only for the same inputs: other
    constraints, another Workbench requirement, or a new wheel in install.wheels resolve anew."""
    import zipfile

    from workbench.targets.named import InstallSpec
    from workbench.targets.wheels import _inputs_key

    def wheel(requires: str) -> Path:
        p = tmp_path / "workbench-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("workbench-0.1.0.dist-info/METADATA",
                       f"Name: workbench\nVersion: 0.1.0\nRequires-Dist: {requires}\n")
        return p

    mine = tmp_path / "mine"
    mine.mkdir()
    pins = tmp_path / "constraints.txt"
    pins.write_text("peft==0.13.0\n")
    cfg = InstallSpec(wheels=str(mine))
    reqs = ["workbench-0.1.0-py3-none-any.whl", "torch==2.13.0"]

    def key() -> str:
        return _inputs_key(["wheel"], pins, tmp_path / reqs[0].split("[")[0], reqs, [], cfg)

    wheel("peft>=0.12")
    first = key()
    assert key() == first
    wheel("peft>=0.12")  # the same Workbench built again
    assert key() == first
    changes = []
    pins.write_text("peft==0.14.0\n")
    changes.append(key())
    wheel("peft>=0.14")
    changes.append(key())
    (mine / "peft-0.14.0-py3-none-any.whl").write_bytes(b"")
    changes.append(key())
    reqs[0] += "[gpu]"
    changes.append(key())
    assert len({first, *changes}) == 5


# `pip config list` as this machine prints it: files (global.) and PIP_* variables (:env:).
PIP_HERE = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_the_nodes_pip_configuration_reads_as_uvs_options_or_leaves_the_install_to_pip():
    from workbench.targets.wheels import uv_options

    assert uv_options(PIP_HERE) == {
        "args": ["--index-strategy", "unsafe-best-match",
                 "--constraint", "/etc/xdg/pip/constraints.txt",
                 "--extra-index-url", "file:///opt/pypi/simple",
                 "--extra-index-url", "file:///opt/pypi-more/simple",
                 "--find-links", "/opt/wheels"],
        "env": {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}}
    # A PIP_* variable wins over the install section, which wins over global, as in pip.
    assert uv_options("global.index-url='https://a/simple'\n:env:.index-url='https://c/simple'\n"
                      "install.index-url='https://b/simple'\nglobal.timeout='7.6'\n") == {
        "args": ["--index-strategy", "unsafe-best-match", "--index-url", "https://c/simple"],
        "env": {"UV_HTTP_TIMEOUT": "8"}}
    assert uv_options("install.trusted-host='mirror.lan'\ndownload.proxy='http://p:3128'\n") == {
        "args": ["--index-strategy", "unsafe-best-match", "--allow-insecure-host", "mirror.lan"],
        "env": {}}  # download. settings are not pip install's
    # What uv is not told here, or no answer from pip at all: pip installs.
    assert uv_options(PIP_HERE + "global.proxy='http://p:3128'\n") is None
    assert uv_options(":env:.no-binary=':all:'\n") is None
    assert uv_options("global.timeout='soon'\n") is None
    assert uv_options(None) is None


def test_the_node_check_probes_the_index_pip_install_would_read(tmp_path):
    """The set-up's node check, run here with this python's pip and a config file of our own:
    the registry it probes is PIP_INDEX_URL's, else [install]'s, else [global]'s."""
    import json
    import os
    import subprocess
    import sys

    from workbench.targets.setup import PREFLIGHT

    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://127.0.0.1:9/global/simple\n"
                    "[install]\nindex-url = http://127.0.0.1:9/install/simple\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}

    def probed(**extra: str) -> dict:
        r = subprocess.run([sys.executable, "-c", PREFLIGHT, str(tmp_path / "venv")],
                           capture_output=True, text=True, timeout=120,
                           env={**env, "PIP_CONFIG_FILE": str(conf), **extra})
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("WB-PREFLIGHT "))
        return json.loads(line.removeprefix("WB-PREFLIGHT "))

    out = probed()
    assert out["index"] == "http://127.0.0.1:9/install/simple"
    assert out["registry"] is False  # nothing listens on port 9 here
    assert "install.index-url='http://127.0.0.1:9/install/simple'" in out["pip_config"]
    assert probed(PIP_INDEX_URL="http://127.0.0.1:9/env/simple")["index"] == \
        "http://127.0.0.1:9/env/simple"
