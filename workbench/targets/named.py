"""Named launch targets (``local``, ``ssh:NAME``, ``slurm:NAME``) saved in WORKBENCH_HOME/targets.yaml.

A target says where a run executes and how to get there: the hosts (or the Slurm login node), the
Python environment on them, the working directory that holds run directories, environment
variables, shell set-up lines (``module load ...``), and defaults for the run spec. The file has
one mapping per kind::

    ssh:
      pair:                              # used as  target: ssh:pair
        hosts: [gpu1, gpu2]              # ~/.ssh/config aliases, HOST, USER@HOST or mappings
        python: /opt/envs/ft/bin/python
        workdir: /scratch/me/workbench
        env: {HF_HOME: /scratch/hf}
        defaults: {resources.gpus_per_node: 8, resources.nodes: 2}
    slurm:
      cluster:                           # used as  target: slurm:cluster
        partition: gpu
        account: proj42
        time: "04:00:00"
        python: /opt/envs/ft/bin/python
        login: login.cluster.org         # omit when the notebook runs on the login node

Probing a target (``workbench targets check NAME``) is :mod:`workbench.targets.check`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from workbench.errors import TargetError
from workbench.runs.home import home
from workbench.secrets import remote_quote, split_env

if TYPE_CHECKING:
    from workbench.spec import RunSpec


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostSpec(_Model):
    """One SSH host: an alias from ~/.ssh/config, a hostname, or USER@HOST."""

    host: str
    port: int | None = None
    user: str | None = None
    workdir: str | None = None  # overrides the target's, e.g. when hosts share no filesystem
    address: str | None = None  # how the other nodes reach this one (default: its HostName)

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user and "@" not in self.host else self.host


class SSHOptions(_Model):
    """How to run ssh. Host keys are checked strictly unless the target turns that off."""

    ssh_config: str | None = None  # passed as ssh -F (default: ~/.ssh/config)
    identity_file: str | None = None
    known_hosts: str | None = None
    strict_host_key_checking: bool = True
    connect_timeout: int = Field(default=10, ge=1)
    ssh_options: dict[str, str] = Field(default_factory=dict)  # more ssh -o KEY=VALUE


class _TargetBase(SSHOptions):
    python: str = "python3"  # interpreter that has workbench, torch and friends installed
    serve_python: str | None = None  # the one with vLLM, when it is another environment
    workdir: str | None = None  # folder that holds run directories on the target
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)  # shell lines run first, e.g. module load
    defaults: dict[str, Any] = Field(default_factory=dict)  # dotted RunSpec fields -> values

    @field_validator("setup", mode="before")
    @classmethod
    def _one_line_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def shell_prefix(self, env_file: str | None = None) -> str:
        """``set -e; set-up lines; export K=V ...; . ENV_FILE; `` to put before a remote shell
        command. Only the plain ``env`` entries are inline: a command line shows in ``ps`` on both
        ends, so the secret ones come from ``env_file`` (see :meth:`remote_shell_prefix`).

        ``set -e`` makes a failing set-up line stop the command (with its error text) instead
        of starting the run in a half-prepared environment.
        """
        parts = ["set -e", *self.setup]
        plain = split_env(self.env)[0]
        if plain:
            parts.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plain.items()))
        if env_file:
            parts.append(f". {remote_quote(env_file)}")
        return "".join(f"{p}; " for p in parts)

    def remote_shell_prefix(self, transport: Any, place: str,
                            extra: dict[str, str] | None = None) -> str:
        """:meth:`shell_prefix` for commands run through ``transport``, secrets included: the
        secret entries of ``env`` (and of ``extra``) go through stdin into an owner-only file
        beside ``place`` (workbench.secrets.env_file_path), which the command sources. The plain
        entries of ``extra`` are exported inline after it."""
        from workbench.secrets import write_secret_env

        extra = extra or {}
        env_file = write_secret_env(transport, {**self.env, **extra}, place)
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in split_env(extra)[0].items())
        return self.shell_prefix(env_file=env_file) + exports


class SSHTarget(_TargetBase):
    kind: Literal["ssh"] = "ssh"
    name: str = ""
    hosts: list[HostSpec] = Field(min_length=1)
    workdir: str = "~/workbench-runs"
    rdzv_port: int | None = None  # None: a free port on the first host, chosen at submit

    @field_validator("hosts", mode="before")
    @classmethod
    def _hosts(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        return [{"host": h} if isinstance(h, str) else h for h in v]

    @property
    def ref(self) -> str:
        return f"ssh:{self.name}"


class SlurmTarget(_TargetBase):
    kind: Literal["slurm"] = "slurm"
    name: str = ""
    login: HostSpec | None = None  # sbatch over SSH on this host; None: sbatch runs here
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"  # --time; a job past it ends "failed" saying the limit expired
    cpus_per_task: int | None = Field(None, ge=1)  # None: 4 per process (2 on CPU runs)
    mem: str | None = None  # --mem per node, e.g. 64G; None: the partition's default
    requeue: bool = True
    sbatch_options: list[str] = Field(default_factory=list)  # extra lines, e.g. --constraint=a100

    @field_validator("login", mode="before")
    @classmethod
    def _login(cls, v: Any) -> Any:
        return {"host": v} if isinstance(v, str) else v

    @property
    def ref(self) -> str:
        return f"slurm:{self.name}"


Target = SSHTarget | SlurmTarget


def targets_file() -> Path:
    return home() / "targets.yaml"


def load_targets(path: Path | None = None) -> dict[str, Target]:
    """Every configured target by reference (``ssh:NAME``, ``slurm:NAME``)."""
    path = path or targets_file()
    if not path.is_file():
        return {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise TargetError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{path}: expected a mapping with 'ssh:' and/or 'slurm:' sections")
    out: dict[str, Target] = {}
    for kind, model in (("ssh", SSHTarget), ("slurm", SlurmTarget)):
        section = raw.get(kind) or {}
        for name, body in section.items():
            try:
                out[f"{kind}:{name}"] = model.model_validate({**(body or {}), "name": name})
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                    for e in exc.errors())
                raise TargetError(f"{path}: {kind}.{name}: {problems}") from None
    unknown = set(raw) - {"ssh", "slurm"}
    if unknown:
        raise TargetError(f"{path}: unknown section(s) {sorted(unknown)}; use 'ssh:' and 'slurm:'")
    return out


def target_names(current: str | None = None) -> list[str]:
    """What a run form offers: ``local`` first, then every configured target."""
    try:
        names = ["local", *load_targets()]
    except TargetError:
        names = ["local"]  # a broken file must not break the form; `targets check` says why
    if current and current not in names:
        names.append(current)
    return names


def get_target(ref: str) -> Target:
    targets = load_targets()
    if ref in targets:
        return targets[ref]
    known = ", ".join(targets) or "none"
    raise TargetError(
        f"target {ref!r} is not configured (known: {known}); add it to {targets_file()} "
        "(see docs/targets.md)"
    )


def save_target(target: Target, path: Path | None = None) -> None:
    """Add or replace one target in targets.yaml (keeps the others)."""
    path = path or targets_file()
    raw = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
    body = target.model_dump(mode="json", exclude_defaults=True, exclude={"name", "kind"})
    raw.setdefault(target.kind, {})[target.name] = body
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")


def apply_defaults(spec: RunSpec, target: Target) -> RunSpec:
    """``spec`` with the target's defaults (dotted field paths) where the spec left them unset.

    A field counts as set when the spec's YAML or mapping named it (pydantic's
    ``model_fields_set``), so an explicit ``resources.nodes: 1`` beats a default of 2.
    """
    unset = {}
    for dotted, value in target.defaults.items():
        node: Any = spec
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = getattr(node, p, None)
        if node is not None and leaf not in getattr(node, "model_fields_set", {leaf}):
            unset[dotted] = value
    return spec.updated(**unset) if unset else spec
