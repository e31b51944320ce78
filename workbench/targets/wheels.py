"""What a target's environment is installed from: the torch build for the node's driver, the
requirements (this Workbench's extras and torch of the notebook's release), the notebook's other
package versions as constraints, a wheel of this Workbench, and, for a target that reaches no
registry, every wheel it needs, downloaded here into a cache (WORKBENCH_HOME/wheelhouse); and
the node's pip configuration read as uv's options, where uv can be told all of it.

:mod:`workbench.targets.setup` carries them to the target and installs them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import distribution, distributions
from pathlib import Path
from typing import Any

from workbench.errors import SetupError
from workbench.runs.home import home
from workbench.targets.check import release
from workbench.targets.named import InstallSpec

CUDA_BUILDS = (118, 121, 124, 126, 128, 129, 130)  # torch wheel variants cuXYZ on PyTorch's index
NOT_PINNED = {"workbench", "workbench-lab", "torch", "triton", "pip", "setuptools", "wheel"}


def cuda_build(cfg: InstallSpec, driver: int | None) -> str:
    """The torch variant: ``cuXYZ`` for the node's driver (or as asked), ``""`` for CPU."""
    if cfg.torch.startswith("cu"):
        return cfg.torch
    if cfg.torch == "cpu" or not driver or cfg.torch.startswith("torch"):
        return ""
    fits = [b for b in CUDA_BUILDS if b <= driver]
    return f"cu{fits[-1]}" if fits else ""


def requirements(cfg: InstallSpec, here: dict[str, str], cuda: str) -> tuple[list[str], str]:
    """(["[extras]", torch requirement], the extra index for torch or "")."""
    extras = sorted(set(cfg.extras) | ({"gpu"} if cuda else set()))
    torch = cfg.torch if cfg.torch.startswith("torch") else f"torch=={release(here['torch'])}"
    index = ("" if cfg.torch_index == "none" else cfg.torch_index if cfg.torch_index != "auto"
             else f"https://download.pytorch.org/whl/{cuda or 'cpu'}")
    return [f"[{','.join(extras)}]" if extras else "", torch], index


def constraints() -> str:
    """The notebook's versions of every package the target's environment may need."""
    pins: dict[str, str] = {}
    for d in distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if (name and name not in NOT_PINNED and not name.startswith("nvidia-")
                and d.read_text("direct_url.json") is None):
            pins.setdefault(name, f"{name}=={d.version}")
    return "\n".join(sorted(pins.values())) + "\n"


def workbench_wheel(out: Path, progress: Callable[[str], None]) -> None:
    """A wheel of the Workbench this notebook imports: built from its checkout, or repacked from
    the installed files when it is not one."""
    root = Path(__file__).resolve().parents[2]  # above the workbench package
    if (root / "pyproject.toml").is_file():
        progress(f"building the Workbench wheel from {root}")
        with tempfile.TemporaryDirectory(prefix="wb-src-") as src:
            for name in ("pyproject.toml", "README.md"):
                shutil.copy(root / name, src)
            shutil.copytree(root / "workbench", Path(src) / "workbench",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                                "--no-build-isolation", "-w", str(out), src],
                               capture_output=True, text=True)
            if r.returncode:
                raise SetupError(f"building the Workbench wheel failed: {output_tail(r.stderr.split())}")
        return
    _repack(out)


def _repack(out: Path) -> None:
    """The installed workbench distribution as a wheel (its RECORD lists its files)."""
    import zipfile

    dist = distribution("workbench")
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts]
    whl = out / f"workbench-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            p = Path(str(f.locate()))
            if p.is_file() and f.name != "RECORD":
                z.write(p, str(f))
        info = next(str(f.parent) for f in files if f.name == "METADATA")
        z.writestr(f"{info}/RECORD", "")


def wheelhouse(stage: Path, reqs: list[str], index: str, node: dict[str, Any],
               cfg: InstallSpec, progress: Callable[[str], None]) -> None:
    """Every wheel the target needs, and uv's to install them with, into ``stage``, from a cache
    here (WORKBENCH_HOME/wheelhouse, one folder per Python, platform and torch build) filled from
    this machine's registry; a wheel of a version the target's venv already has
    (``node["installed"]``) stays here. The cache keeps what each set of inputs resolved to, so a
    set-up again with the same requirements asks no registry."""
    import sysconfig

    tag = f"cp{node['python'].replace('.', '')}-{node['platform']}-{index.rsplit('/', 1)[-1] or 'any'}"
    cache = home() / "wheelhouse" / tag
    cache.mkdir(parents=True, exist_ok=True)
    links = ["--find-links", str(cache), "--find-links", str(stage)]
    if cfg.wheels:
        links += ["--find-links", str(Path(cfg.wheels).expanduser())]
    same = (node["platform"] == sysconfig.get_platform()
            and node["python"] == "{}.{}".format(*sys.version_info[:2]))
    if same:  # pip wheel also builds the packages PyPI has only as sources
        cmd = [sys.executable, "-m", "pip", "wheel", "--progress-bar", "off", "-w", str(cache)]
    else:
        arch = node["platform"].split("-", 1)[-1]
        minor = int((node["glibc"] or "2.17").split(".")[1])
        plats = [f"manylinux_2_{m}_{arch}" for m in range(17, minor + 1)] + [f"linux_{arch}"]
        cmd = [sys.executable, "-m", "pip", "download", "--progress-bar", "off", "-d", str(cache),
               "--only-binary=:all:", "--python-version", node["python"], "--implementation", "cp"]
        cmd += [a for p in plats for a in ("--platform", p)]
    extra = ["--extra-index-url", index] if index else []
    constraint = stage / "constraints.txt"
    wheel = stage / reqs[0].split("[")[0]
    known = cache / f"resolved-{_inputs_key(cmd[3:], constraint, wheel, reqs, extra, cfg)}.txt"
    names = known.read_text().split() if known.is_file() else []
    if not names or not all((cache / n).is_file() for n in names):
        progress(f"downloading the wheels here into {cache} (kept for the next set-up)")
        r = subprocess.run(cmd + links + ["-c", str(constraint), str(stage / reqs[0]), *reqs[1:]]
                           + extra, capture_output=True, text=True)
        if r.returncode:
            raise SetupError(f"no registry there and no wheels here: this machine could not get "
                             f"them ({output_tail(r.stderr.splitlines())}); put the wheels in a "
                             "folder and set install.wheels to it")
        # uv installs the carried wheels on the target, several times faster than pip; without
        # it (a wheels folder without uv, an offline machine), pip does.
        subprocess.run(cmd + links + ["--no-deps", "-c", str(constraint), "uv"] + extra,
                       capture_output=True)
        names = sorted(p.name for p in cache.glob("*.whl"))
        known.write_text("\n".join(names) + "\n")
    there = {dist_key(d) for d in node.get("installed") or []}
    for name in names:
        if not name.startswith("workbench-") and dist_key(name) not in there:
            try:  # the install needs them beside the Workbench wheel
                (stage / name).hardlink_to(cache / name)
            except OSError:
                shutil.copy(cache / name, stage / name)


def _inputs_key(cmd: list[str], constraint: Path, wheel: Path, reqs: list[str],
                extra: list[str], cfg: InstallSpec) -> str:
    """A digest of what a wheelhouse download resolves from: the command's options (platform,
    Python), the constraints, the Workbench wheel's own requirements, the extras, torch and its
    index, and the wheels folder's wheels."""
    import hashlib
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    requires = [ln for ln in meta.decode().splitlines() if ln.startswith("Requires-Dist:")]
    parts = [*cmd, constraint.read_text(), *requires, *reqs[1:], reqs[0].partition("[")[2],
             *extra, *(sorted(p.name for p in Path(cfg.wheels).expanduser().glob("*.whl"))
                       if cfg.wheels else [])]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def dist_key(name: str) -> tuple[str, str]:
    """(project, version) of a wheel's file name or a dist-info folder's name (PEP 427/503: the
    project with runs of ``-_.`` as one ``-``, lower case)."""
    project, version = name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", project).lower(), version


# pip settings uv is told the same way (pip's key: uv's option, one per value), those it reads
# from the environment, and those that change nothing about what is installed. A pip
# configuration with any other setting (a proxy, a client certificate, no-binary, ...) is left
# to pip.
_UV_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
               "find-links": "--find-links", "constraint": "--constraint",
               "trusted-host": "--allow-insecure-host"}
_UV_ENV = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT",
           "default-timeout": "UV_HTTP_TIMEOUT"}
_NO_EFFECT = {"disable-pip-version-check", "no-input", "progress-bar", "quiet", "verbose",
              "no-color", "root-user-action", "no-warn-script-location", "no-compile",
              "retries", "cache-dir", "no-cache-dir"}


def uv_options(pip_config: str | None) -> dict[str, Any] | None:
    """What ``pip config list`` printed on the node, as ``uv pip install``'s options and
    environment ({"args": [...], "env": {...}}), so that uv installs from what pip would; None
    (install with pip) where that output is missing or sets anything uv is not told here.

    pip's sections apply to ``pip install`` as global < install < the environment (PIP_*); uv
    looks at every index for the best version, as pip does (``unsafe-best-match``)."""
    import ast

    if pip_config is None:
        return None
    merged: dict[str, str] = {}
    lines = [ln.partition("=") for ln in pip_config.splitlines() if "=" in ln]
    for section in ("global", "install", ":env:"):
        for name, _, value in lines:
            where, _, key = name.rpartition(".")
            if where == section:
                try:  # pip prints each value as Python's repr
                    merged[key] = str(ast.literal_eval(value.strip()))
                except (ValueError, SyntaxError):
                    return None
    args, env = ["--index-strategy", "unsafe-best-match"], {}
    for key, value in merged.items():
        if key in _UV_OPTIONS:
            args += [a for v in value.split() for a in (_UV_OPTIONS[key], v)]
        elif key in _UV_ENV:
            if _UV_ENV[key] == "UV_HTTP_TIMEOUT":  # whole seconds, where pip takes any number
                try:
                    value = str(max(1, round(float(value))))
                except ValueError:
                    return None
            env[_UV_ENV[key]] = value
        elif key not in _NO_EFFECT:
            return None
    return {"args": args, "env": env}


def output_tail(lines: list[str]) -> str:
    text = " ".join(ln.strip() for ln in lines[-3:] if ln.strip())
    return text[-400:] or "no output"
