"""reproduce.zip: everything needed to understand and re-run a run, with secrets scrubbed.

The supervisor writes RUN_DIR/reproduce.zip when a run ends: spec, plan, status, code version
(workbench version and git commit), pip freeze, command lines, logs, TensorBoard events, and the
checksums of every snapshot and final artefact. :func:`compare_bundle` (``workbench reproduce
BUNDLE``) re-creates the RunSpec and reports how the current environment differs.

Secrets never enter a bundle: what :mod:`workbench.targets.secrets` finds secret (values of environment
variables whose names look secret, token-shaped strings) is replaced by ``***`` in every text file
before it is written.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.runs.rundir import RunDir
from workbench.runs.snapshots import sha256_file as _sha256
from workbench.spec import RunSpec
from workbench.targets.secrets import scrub, secret_values

BUNDLE = "reproduce.zip"
_TEXT_SUFFIXES = {".log", ".json", ".jsonl", ".yaml", ".yml", ".txt", ".out", ".md", ".sbatch",
                  ".sh", ".py"}


def code_version() -> dict[str, Any]:
    from workbench._version import __version__

    src = Path(__file__).resolve().parent  # the workbench package folder
    info: dict[str, Any] = {"workbench": __version__, "python": sys.version.split()[0],
                            "platform": platform.platform()}
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                                   capture_output=True, text=True, timeout=10)
            info["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def pip_freeze() -> str:
    """What ``pip freeze --all`` prints, read from the installed packages' metadata in this
    process (importlib.metadata): running pip would add its own start-up (over a second) to
    the end of every run.

    ``name==version``; ``name @ URL`` for a package installed from a URL (pip's direct_url.json);
    an editable install as pip writes one without version control (a comment, ``-e PATH``).
    The first of a name on ``sys.path`` wins, as for imports and for pip.
    """
    from importlib import metadata

    seen: dict[str, tuple[str, str]] = {}  # canonical name: (name, line)
    for dist in metadata.distributions():
        name, version = _name_and_version(dist.read_text("METADATA") or "")
        key = name.lower().replace("_", "-").replace(".", "-")
        if name and key not in seen:
            seen[key] = (name, _freeze_line(dist, name, version))
    return "".join(line + "\n" for _, line in sorted(seen.values(), key=lambda n: n[0].lower()))


def _name_and_version(text: str) -> tuple[str, str]:
    """Name and Version from a METADATA header (``dist.metadata`` runs the email parser over the
    whole file: ~0.5 s for a venv's packages, most of this function's cost)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line:  # the header ends at the first empty line
            break
        key, _, value = line.partition(":")
        if key in ("Name", "Version") and key not in found:
            found[key] = value.strip()
    return found.get("Name", ""), found.get("Version", "")


def _freeze_line(dist: Any, name: str, version: str) -> str:
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if not isinstance(direct, dict) or "url" not in direct:
        return f"{name}=={version}"
    url = str(direct["url"])
    if (direct.get("dir_info") or {}).get("editable"):
        return _editable_line(url.removeprefix("file://"), name, version)
    vcs = direct.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs"):
        url = f"{vcs['vcs']}+{url}@{vcs.get('commit_id', '')}"
    return f"{name} @ {url}"


def _editable_line(path: str, name: str, version: str) -> str:
    """An editable install as pip freeze names it: from a git checkout with a remote, that
    remote at the checkout's commit (what a reproduction needs); else the folder, with pip's
    comment saying why."""
    import subprocess

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    if not git("rev-parse", "--is-inside-work-tree"):
        return f"# Editable install with no version control ({name}=={version})\n-e {path}"
    remote, commit = git("config", "--get", "remote.origin.url"), git("rev-parse", "HEAD")
    if not remote or not commit:
        return f"# Editable Git install with no remote ({name}=={version})\n-e {path}"
    if remote.startswith("/"):
        remote = f"file://{remote}"
    elif "://" not in remote and ":" in remote:  # scp-like user@host:path, as pip rewrites it
        host, _, where = remote.partition(":")
        remote = f"ssh://{host}/{where}"
    return f"-e git+{remote}@{commit}#egg={name}"


def write_bundle(rd: RunDir, final_status: dict[str, Any] | None = None) -> Path:
    """Write RUN_DIR/reproduce.zip (atomically) and return its path.

    ``final_status`` is merged into the bundled status.json: the supervisor bundles just before
    it records the terminal state, so that a reader who sees the state also finds the bundle.
    """
    secrets = secret_values()
    status = {**rd.status(), **(final_status or {})}
    checksums: dict[str, Any] = {"artefacts": {}, "snapshots": {}}
    art = rd.artefact_dir()
    if art is not None:
        checksums["artefacts"] = {str(p.relative_to(rd.path)): _sha256(p)
                                  for p in sorted(art.rglob("*")) if p.is_file()}
    for manifest in sorted((rd.path / "checkpoints").glob("step-*/manifest.json")):
        checksums["snapshots"][manifest.parent.name] = json.loads(manifest.read_text())["files"]
    generated = {
        "version.json": json.dumps(code_version(), indent=1),
        "requirements.txt": pip_freeze(),
        "commands.json": json.dumps({"ranks": status.get("command"),
                                     "supervisor": [sys.executable, "-m", "workbench.runs.supervise",
                                                    str(rd.path)]}, indent=1),
        "checksums.json": json.dumps(checksums, indent=1),
    }
    generated["status.json"] = json.dumps(status, indent=1, default=str)
    files = [rd.spec_file, rd.plan_file, rd.metrics_file, rd.resume_file,
             rd.data_dir / "summary.json", *rd.log_files()]
    files += [p for p in sorted(rd.tb_dir.rglob("*")) if p.is_file()] if rd.tb_dir.is_dir() else []
    tmp = rd.path / f".{BUNDLE}.{os.getpid()}.tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, text in generated.items():
            zf.writestr(name, scrub(text, secrets))
        for path in files:
            if not path.is_file():
                continue
            arc = str(path.relative_to(rd.path))
            if path.suffix in _TEXT_SUFFIXES:
                zf.writestr(arc, scrub(path.read_text(encoding="utf-8", errors="replace"), secrets))
            else:
                zf.write(path, arc)
        zf.writestr("bundle.json", json.dumps({"run_id": rd.path.name, "created": time.time(),
                                               "format": 1}))
    final = rd.path / BUNDLE
    os.replace(tmp, final)
    return final


@dataclass
class ReproduceReport:
    """What a bundle describes, and how this environment differs from the one that ran it."""

    spec: RunSpec
    run_id: str
    recorded: dict[str, Any]
    current: dict[str, Any]
    packages_changed: dict[str, tuple[str, str]] = field(default_factory=dict)
    packages_missing: dict[str, str] = field(default_factory=dict)
    packages_added: dict[str, str] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        same_code = all(self.recorded.get(k) == self.current.get(k)
                        for k in ("workbench", "python", "git_commit"))
        return same_code and not (self.packages_changed or self.packages_missing
                                  or self.packages_added)

    def summary(self) -> str:
        lines = [f"run {self.run_id}: spec {self.spec.name!r}, model {self.spec.model.id}"]
        for key in ("workbench", "python", "git_commit", "platform"):
            a, b = self.recorded.get(key), self.current.get(key)
            lines.append(f"  {key:10} {a}" + ("" if a == b else f"  (now {b})"))
        if self.identical:
            lines.append("  environment: identical packages")
        for name, (a, b) in sorted(self.packages_changed.items()):
            lines.append(f"  changed  {name} {a} -> {b}")
        for name, v in sorted(self.packages_missing.items()):
            lines.append(f"  missing  {name}=={v}")
        for name, v in sorted(self.packages_added.items()):
            lines.append(f"  added    {name}=={v}")
        return "\n".join(lines)


def _parse_freeze(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[name.lower()] = version
        elif " @ " in line:
            name, where = line.split(" @ ", 1)
            out[name.lower()] = where
    return out


def compare_bundle(path: str | Path) -> ReproduceReport:
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"bundle {path} not found; it is RUN_DIR/{BUNDLE} of a finished run")
    try:
        with zipfile.ZipFile(path) as zf:
            spec = RunSpec.from_yaml(zf.read("spec.yaml").decode())
            recorded = json.loads(zf.read("version.json"))
            frozen = _parse_freeze(zf.read("requirements.txt").decode())
            run_id = json.loads(zf.read("bundle.json"))["run_id"]
    except (zipfile.BadZipFile, KeyError) as exc:
        raise WorkbenchError(f"{path} is not a workbench reproduce bundle ({exc})") from None
    now = _parse_freeze(pip_freeze())
    report = ReproduceReport(spec=spec, run_id=run_id, recorded=recorded, current=code_version())
    for name, version in frozen.items():
        if name not in now:
            report.packages_missing[name] = version
        elif now[name] != version:
            report.packages_changed[name] = (version, now[name])
    report.packages_added = {n: v for n, v in now.items() if n not in frozen}
    return report
