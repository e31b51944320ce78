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

A mistake in one entry (a misspelt field, a wrong type) leaves the other targets usable: the
entry is left out of :func:`load_targets`, and using it (:func:`get_target`, a launch, ``workbench
targets check``) raises what is wrong with it, with a "did you mean" for a misspelt field. Only a
file that is not YAML, or whose sections are not ``ssh:``/``slurm:`` mappings, stops every target.

Probing a target (``workbench targets check NAME``) is :mod:`workbench.targets.check`.
"""

from __future__ import annotations

import difflib
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from workbench.errors import TargetError
from workbench.runs.home import home
from workbench.targets.secrets import remote_quote, split_env

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
    # More ssh -o KEY=VALUE. YAML reads `Port: 2222` as a number and `yes` as true: both are
    # accepted, and written as ssh wants them where the command is built (transport.SSHTransport).
    ssh_options: dict[str, str | bool | int | float] = Field(default_factory=dict)


class InstallSpec(_Model):
    """What ``workbench targets setup`` makes on the target (workbench.targets.setup): a venv
    with this notebook's Workbench and a torch of its release built for the node (CUDA or CPU)."""

    venv: str | None = None  # default: ~/.workbench/envs/NAME (a Slurm target without login:
    #                          WORKBENCH_HOME/envs/NAME); on Slurm, a folder the compute nodes see
    python: str = "python3"  # the interpreter on the target that makes the venv (python3 -m venv)
    source: Literal["auto", "registry", "wheels"] = "auto"  # auto: the registry if the target
    #                          reaches one, else wheels downloaded here and carried over SSH
    torch: str = "auto"  # auto (CUDA build for the node's driver, else CPU), cpu, cu126, ...
    #                      or a whole requirement such as "torch==2.5.1+cu121"
    torch_index: str = "auto"  # auto: download.pytorch.org/whl/VARIANT; none; or an index URL
    extras: list[str] = Field(default_factory=list)  # Workbench extras; "gpu" is added on CUDA
    wheels: str | None = None  # a folder here of wheels to carry and prefer (make gpu-wheels)
    time: str = "00:30:00"  # the Slurm set-up job's time limit


class _TargetBase(SSHOptions):
    python: str = "python3"  # interpreter that has workbench, torch and friends installed
    serve_python: str | None = None  # the one with vLLM, when it is another environment
    workdir: str | None = None  # folder that holds run directories on the target
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)  # shell lines run first, e.g. module load
    defaults: dict[str, Any] = Field(default_factory=dict)  # dotted RunSpec fields -> values
    install: InstallSpec | None = None  # how `workbench targets setup` makes `python`

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
        beside ``place`` (workbench.targets.secrets.env_file_path), which the command sources. The plain
        entries of ``extra`` are exported inline after it."""
        from workbench.targets.secrets import write_secret_env

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
    cpus_per_task: int | None = Field(None, ge=1)  # None: 4 per process (1 on CPU runs)
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
    """Every configured target by reference (``ssh:NAME``, ``slurm:NAME``), except entries with a
    mistake (:func:`target_problems` says what each is)."""
    return _read(path)[0]


def target_problems(path: Path | None = None) -> dict[str, TargetError]:
    """What is wrong with each entry of targets.yaml that cannot be used, by reference."""
    return _read(path)[1]


def _read(path: Path | None) -> tuple[dict[str, Target], dict[str, TargetError]]:
    path = path or targets_file()
    if not path.is_file():
        return {}, {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise TargetError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{path}: expected a mapping with 'ssh:' and/or 'slurm:' sections")
    unknown = sorted(set(raw) - {"ssh", "slurm"})
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(str(k), ["ssh", "slurm"], 1)]
        hint = f" (did you mean {' and '.join(repr(m) for m in close)}?)" if close else ""
        raise TargetError(f"{path}: unknown section(s) {unknown}{hint}; use 'ssh:' and 'slurm:'")
    good: dict[str, Target] = {}
    bad: dict[str, TargetError] = {}
    for kind, model in (("ssh", SSHTarget), ("slurm", SlurmTarget)):
        section = raw.get(kind) or {}
        if not isinstance(section, dict):
            raise TargetError(f"{path}: {kind}: expected a mapping of target names to their "
                              "fields (see docs/targets.md)")
        for name, body in section.items():
            ref = f"{kind}:{name}"
            if body is not None and not isinstance(body, dict):
                bad[ref] = TargetError(f"{path}: {kind}.{name}: expected a mapping of fields, got "
                                       f"{body!r} (see docs/targets.md)")
                continue
            try:
                good[ref] = model.model_validate({**(body or {}), "name": name})
            except ValidationError as exc:
                problems = "; ".join(_problem(model, e) for e in exc.errors())
                bad[ref] = TargetError(f"{path}: {kind}.{name}: {problems}")
    return good, bad


def _problem(model: type[BaseModel], error: Any) -> str:
    """One validation error of a target entry as ``field: message``; a field the entry's model
    does not have gets the closest one it has (difflib, as a RunSpec's unknown field does)."""
    loc = [str(p) for p in error["loc"]]
    if error["type"] != "extra_forbidden":
        return f"{'.'.join(loc) or '<root>'}: {error['msg']}"
    owner: type[BaseModel] = model
    for part in loc[:-1]:  # down to the model that holds the field: a host, the login node
        field = owner.model_fields.get(part)
        inner = [a for a in getattr(field.annotation, "__args__", ()) if isinstance(a, type)
                 and issubclass(a, BaseModel)] if field is not None else []
        if inner:
            owner = inner[0]
    allowed = sorted(set(owner.model_fields) - {"kind", "name"})
    close = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{'.'.join(loc)}: unknown field; {hint}allowed fields: {', '.join(allowed)}"


def target_names(current: str | None = None) -> list[str]:
    """What a run form offers: ``local`` first, then every configured target (one whose entry has
    a mistake too: launching it says what the mistake is)."""
    try:
        good, bad = _read(None)
        names = ["local", *good, *bad]
    except TargetError:
        names = ["local"]  # a broken file must not break the form; `targets check` says why
    if current and current not in names:
        names.append(current)
    return names


def get_target(ref: str) -> Target:
    """The target ``ref``; a TargetError saying what is wrong when its entry has a mistake."""
    targets, problems = _read(None)
    if ref in targets:
        return targets[ref]
    if ref in problems:
        raise problems[ref]
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
