"""Setting a target up: ``workbench targets setup NAME`` (:func:`setup_target`).

This module owns making the Python environment a target runs in: a venv at ``install.venv``
(targets.yaml, :class:`workbench.targets.named.InstallSpec`) with this notebook's Workbench (a
wheel built from this checkout), the notebook's other package versions as constraints, and a
torch of the notebook's release built for the node (CUDA for its driver, else CPU). Packages come
from the registry where the target reaches one, else as wheels downloaded here, carried over the
target's SSH (or this machine's shell) and installed with ``--no-index``; ``uv pip install``
installs them where uv can be told what the node's pip would read, else pip. On Slurm the
install runs as a short ``srun`` job on a compute node; the venv then lives on the shared
filesystem. Once it imports, the environment is marked done (``VENV/.workbench-setup.json``) and
its python recorded as the target's ``python:``. A set-up that fails records nothing, raises a
:class:`SetupError` that says what to do, and removes the venv it made; a venv set up before that
still imports is kept. What is installed (the torch build, requirements, constraints, the
Workbench wheel, a wheelhouse) is :mod:`workbench.targets.wheels`'s to choose and gather; this
module looks at the node, carries the packages there and installs them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import SetupError
from workbench.runs.home import home
from workbench.targets.backends.transport import LocalTransport, SSHTransport, Transport
from workbench.targets.check import notebook_versions, release
from workbench.targets.named import (
    InstallSpec,
    SlurmTarget,
    SSHTarget,
    Target,
    TargetError,
    get_target,
    save_target,
)
from workbench.targets.wheels import (
    constraints,
    cuda_build,
    output_tail,
    requirements,
    uv_options,
    wheelhouse,
    workbench_wheel,
)

MARKER = ".workbench-setup.json"


@dataclass
class SetupResult:
    target: str
    python: str
    workbench: str
    torch: str
    source: str  # "registry" or "wheels"
    seconds: float

    def __repr__(self) -> str:
        return (f"{self.target} is set up: {self.python} (workbench {self.workbench}, torch "
                f"{self.torch}, from {self.source}) in {self.seconds:.0f} s; `workbench targets "
                f"check {self.target}` tests it")


# Runs with the target's base python (stdlib only): what the set-up needs to know of the node.
PREFLIGHT = r"""
import ast, json, os, platform, re, shutil, subprocess, sys, sysconfig, urllib.request
venv = os.path.abspath(os.path.expanduser(sys.argv[1]))
out = {"venv": venv, "python": "%d.%d" % sys.version_info[:2], "platform": sysconfig.get_platform(),
       "glibc": platform.libc_ver()[1], "cuda": None}
try:
    import ensurepip, venv as _v
    out["venv_ok"] = True
except ImportError as exc:
    out["venv_ok"], out["venv_error"] = False, str(exc)
parent = os.path.dirname(venv)
try:
    os.makedirs(parent, exist_ok=True)
    t = os.path.join(parent, ".workbench-write-test"); open(t, "w").close(); os.remove(t)
    out["writable"] = True
except OSError as exc:
    out["writable"], out["write_error"] = False, str(exc)
out["exists"] = os.path.exists(venv) and bool(os.listdir(venv) if os.path.isdir(venv) else 1)
out["ours"] = any(os.path.exists(os.path.join(venv, f)) for f in (%(marker)r, ".workbench-partial"))
# What a complete venv has (name-version of each dist-info): their wheels need not be carried.
out["installed"] = []
if os.path.exists(os.path.join(venv, %(marker)r)) and not os.path.exists(
        os.path.join(venv, ".workbench-partial")):
    for lib in os.listdir(os.path.join(venv, "lib")):
        site = os.path.join(venv, "lib", lib, "site-packages")
        if os.path.isdir(site):
            out["installed"] += [d[:-len(".dist-info")] for d in os.listdir(site)
                                 if d.endswith(".dist-info")]
if shutil.which("nvidia-smi"):
    r = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", r.stdout)
    out["cuda"] = int(m.group(1)) * 10 + int(m.group(2)) if m else None
# What pip reads from its files and PIP_* variables here: uv is told the same (wheels.uv_options).
r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
out["pip_config"] = r.stdout if r.returncode == 0 else None
# The index `pip install` reads: PIP_INDEX_URL over [install] over [global], else PyPI's.
index = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
if out["pip_config"] is not None:
    found = {}
    for ln in out["pip_config"].splitlines():
        name, _, value = ln.partition("=")
        if name.endswith(".index-url"):  # not extra-index-url: that ends in "-index-url"
            try:  # pip prints each value as Python's repr
                found[name[:-len(".index-url")]] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                pass
    index = next((found[s] for s in (":env:", "install", "global") if found.get(s)), index)
out["index"] = index
try:
    urllib.request.urlopen(index.rstrip("/") + "/pip/", timeout=10).read(1)
    out["registry"] = True
except Exception as exc:
    out["registry"], out["registry_error"] = False, str(exc)[:200]
print("WB-PREFLIGHT " + json.dumps(out))
""".replace("%(marker)r", repr(MARKER))

# Runs with the target's base python: makes (or updates) the venv, installs, verifies, marks it.
INSTALL = r"""
import json, os, shutil, subprocess, sys, time
venv, staged, source = sys.argv[1], sys.argv[2], sys.argv[3]
pip_args, uv_opts = json.loads(sys.argv[4]), json.loads(sys.argv[5])
partial, marker = os.path.join(venv, ".workbench-partial"), os.path.join(venv, %(marker)r)
made = not os.path.exists(os.path.join(venv, "pyvenv.cfg"))
py = os.path.join(venv, "bin", "python")
CHECK = ("import json, workbench.runs.supervise, torch, transformers, peft; from importlib.metadata "
         "import version; print(json.dumps({'workbench': version('workbench'), 'torch': "
         "torch.__version__, 'cuda': torch.cuda.is_available()}))")
def imports():
    # Byte-compiles what a run imports (the install compiles nothing), even where the caller's
    # environment says not to write bytecode: every later run then starts from it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    r = subprocess.run([py, "-c", CHECK], capture_output=True, text=True, env=env)
    return (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None), r
def mark(got, src):
    got.update(source=src, date=time.strftime("%%Y-%%m-%%d %%H:%%M"))
    with open(marker, "w") as fh:
        json.dump(got, fh)
    if os.path.exists(partial):
        os.remove(partial)
    return got
def fail(msg):
    # A venv that was set up before and still imports is kept, marked with what it now has;
    # one this set-up made, or one it left not importing, is removed.
    got = imports()[0] if complete else None
    if got is not None:
        mark(got, before.get("source", source))
        msg += "; the environment set up before is kept, and still imports"
    elif made or os.path.exists(partial):
        shutil.rmtree(venv, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    print("WB-FAIL " + msg, flush=True); sys.exit(3)
complete = not made and os.path.exists(marker) and not os.path.exists(partial)
before = json.load(open(marker)) if complete else {}
if os.path.exists(partial):  # what a failed set-up left: start again
    shutil.rmtree(venv); made = True
if made:
    print("WB: creating the venv " + venv, flush=True)
    r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if r.returncode:
        fail("python3 -m venv failed: " + (r.stderr or r.stdout).strip().splitlines()[-1])
open(partial, "w").close()
if os.path.exists(marker):
    os.remove(marker)
env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
if source == "wheels":
    env["PIP_CONFIG_FILE"] = os.devnull
# uv installs where it is told what pip would read (uv_opts, null where it cannot be): carried
# wheels, with uv's wheel among them; or the registry's packages, with the node's pip
# configuration as uv's options. pip installs uv first, from the same place; without it, pip
# installs everything.
uv = os.path.join(venv, "bin", "uv")
if uv_opts is not None and not os.path.exists(uv):
    if source == "registry":
        subprocess.run([py, "-m", "pip", "install", "-q", "uv"], env=env)
    elif any(f.startswith("uv-") for f in os.listdir(staged)):
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", staged,
                        "uv"], env=env)
use_uv = uv_opts is not None and os.path.exists(uv)
tool = "uv pip install" if use_uv else "pip install"
print("WB: " + tool + " (" + source + ")", flush=True)
# Nothing is byte-compiled here (tens of thousands of modules, most never imported): the import
# check below compiles what a run imports. uv's cache lies in the staged folder, on the venv's
# filesystem: its files are hard-linked into the venv, and it is removed with the staged wheels.
base = ([uv, "pip", "install", "--python", py, "--cache-dir", os.path.join(staged, ".uv-cache"),
         *uv_opts["args"]]
        if use_uv else [py, "-m", "pip", "install", "--progress-bar", "off", "--no-compile"])
r = subprocess.run(base + ["--find-links", staged, "-c", os.path.join(staged, "constraints.txt")]
                   + pip_args, env=dict(env, **uv_opts["env"]) if use_uv else env)
if r.returncode:
    fail(tool + " failed (its output is above)")
got, r = imports()
if got is None:
    fail("the new environment does not import: " + r.stderr.strip().splitlines()[-1])
mark(got, source)
shutil.rmtree(staged, ignore_errors=True)
print("WB-RESULT " + json.dumps(dict(got, python=py)), flush=True)
""".replace("%(marker)r", repr(MARKER)).replace("%%", "%")


class _Place:
    """Where the set-up runs: one SSH host, or (Slurm) a job started from the login shell."""

    def __init__(self, target: Target, transport: Transport, label: str) -> None:
        self.target, self.transport, self.label = target, transport, label

    def wrap(self, command: str, cfg: InstallSpec) -> str:
        t = self.target
        if not isinstance(t, SlurmTarget):
            return t.shell_prefix() + command
        opts = [f"--job-name=wb-setup-{t.name}", "--nodes=1", "--ntasks=1", "--cpus-per-task=2",
                f"--time={cfg.time}"] + [f"--{k}={v}" for k, v in (
                    ("partition", t.partition), ("account", t.account), ("qos", t.qos)) if v]
        inner = t.shell_prefix() + command
        return f"{t.shell_prefix()}srun {' '.join(map(shlex.quote, opts))} bash -c {shlex.quote(inner)}"

    def stream(self, command: str, progress: Callable[[str], None], timeout: float,
               stdin: Any = None) -> tuple[int, list[str]]:
        """Run ``command`` there; lines starting ``WB`` and pip's headline lines go to
        ``progress`` as they come. (exit status, every line)."""
        tr = self.transport
        argv = (tr.ssh_argv() + ["--", "bash -c " + shlex.quote(command)]
                if isinstance(tr, SSHTransport) else ["bash", "-c", command])
        lines: list[str] = []
        proc = subprocess.Popen(argv, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline, collected = time.monotonic() + timeout, 0
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            lines.append(line)
            if line.startswith(("Collecting", "Processing")):
                collected += 1
                if collected % 25 == 0:
                    progress(f"{self.label}: pip has {collected} packages so far")
            elif line.startswith(("WB:", "Installing collected", "ERROR", "error:", "Resolved ",
                                  "Installed ")):
                progress(f"{self.label}: {line.removeprefix('WB: ')[:200]}")
            if time.monotonic() > deadline:
                proc.kill()
                raise SetupError(f"{self.label}: the set-up took longer than {timeout:.0f} s; "
                                 "see the output above, then run it again")
        proc.wait()
        if proc.returncode == 255 and isinstance(tr, SSHTransport):
            raise SetupError(tr.explain("\n".join(lines[-5:])).replace("\n-> ", "; "))
        return proc.returncode, lines


def setup_target(ref: str, *, source: str | None = None,
                 progress: Callable[[str], None] = print) -> SetupResult:
    """Make ``ref``'s environment (see the module docstring) and record its python there."""
    started = time.monotonic()
    if ref == "local":
        raise SetupError("local runs in this environment; `workbench targets setup` is for "
                         "ssh:NAME and slurm:NAME targets")
    try:
        target = get_target(ref)
    except TargetError as exc:
        raise SetupError(str(exc).splitlines()[0]) from None
    cfg = target.install or InstallSpec()
    src = source or cfg.source
    venv = cfg.venv or (str(home() / "envs" / target.name) if isinstance(target, SlurmTarget)
                        and not target.login else f"~/.workbench/envs/{target.name}")
    here = notebook_versions()
    places = ([_Place(target, SSHTransport(h, target), f"{ref} {h.host}") for h in target.hosts]
              if isinstance(target, SSHTarget) else
              [_Place(target, SSHTransport(target.login, target) if target.login
                      else LocalTransport(), f"{ref} (a job)")])
    result: dict[str, Any] = {}
    for place in places:
        result = _setup_place(place, cfg, venv, src, here, progress)
    python = result["python"]
    if target.python != python:
        save_target(target.model_copy(update={"python": python}))
    done = SetupResult(ref, python, result["workbench"], result["torch"], result["source"],
                       time.monotonic() - started)
    progress(repr(done))
    return done


def _setup_place(place: _Place, cfg: InstallSpec, venv: str, src: str, here: dict[str, str],
                 progress: Callable[[str], None]) -> dict[str, Any]:
    ref = place.target.ref
    progress(f"{place.label}: looking at the node (python, venv, GPUs, registry)")
    cmd = f"{shlex.quote(cfg.python)} -c {shlex.quote(PREFLIGHT)} {shlex.quote(venv)}"
    rc, lines = place.stream(place.wrap(cmd, cfg), progress, 600)
    line = next((ln for ln in lines if ln.startswith("WB-PREFLIGHT ")), None)
    if line is None:
        raise SetupError(f"{place.label}: {cfg.python} did not run: {output_tail(lines)}; set "
                         f"install.python of {ref} to a Python 3 that exists there")
    node = json.loads(line.split(" ", 1)[1])
    if not node["venv_ok"]:
        raise SetupError(f"{place.label}: {cfg.python} has no venv module ({node['venv_error']}); "
                         "install it (Debian/Ubuntu: apt install python3-venv) or set "
                         f"install.python of {ref} to a Python that has it")
    if not node["writable"]:
        raise SetupError(f"{place.label}: cannot write {node['venv']}: {node['write_error']}; set "
                         f"install.venv of {ref} to a folder you can write")
    if node["exists"] and not node["ours"]:
        raise SetupError(f"{place.label}: {node['venv']} exists and was not made by `workbench "
                         f"targets setup`; set install.venv of {ref} to a new folder")
    cuda = cuda_build(cfg, node["cuda"])
    if src == "auto":
        src = "registry" if node["registry"] else "wheels"
    elif src == "registry" and not node["registry"]:
        raise SetupError(f"{place.label}: reaches no registry ({node['index']}: "
                         f"{node['registry_error']}); set install.source of {ref} to wheels "
                         "(or auto) to carry wheels from here")
    progress(f"{place.label}: Python {node['python']} on {node['platform']}, "
             f"{'CUDA driver ' + str(node['cuda'] / 10) if node['cuda'] else 'no GPU driver'}; "
             f"packages from {'its registry' if src == 'registry' else 'wheels carried from here'}")
    reqs, index = requirements(cfg, here, cuda)
    with tempfile.TemporaryDirectory(prefix="wb-setup-") as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        workbench_wheel(stage, progress)
        (stage / "constraints.txt").write_text(constraints())
        reqs[0] = str(next(stage.glob("workbench-*.whl")).name) + reqs[0]
        if src == "wheels":
            wheelhouse(stage, reqs, index, node, cfg, progress)
        staged = node["venv"].rstrip("/") + ".setup"
        size = sum(p.stat().st_size for p in stage.iterdir()) / 2**20
        progress(f"{place.label}: copying {len(list(stage.iterdir()))} files ({size:,.0f} MB) "
                 f"to {staged}")
        _copy(place, stage, staged)
    pip_args = ([f"{staged}/{reqs[0]}", *reqs[1:]]
                + (["--no-index"] if src == "wheels" else
                   ["--extra-index-url", index] if index else []))
    uv = {"args": [], "env": {}} if src == "wheels" else uv_options(node.get("pip_config"))
    cmd = (f"{shlex.quote(cfg.python)} -c {shlex.quote(INSTALL)} {shlex.quote(node['venv'])} "
           f"{shlex.quote(staged)} {src} {shlex.quote(json.dumps(pip_args))} "
           f"{shlex.quote(json.dumps(uv))}")
    rc, lines = place.stream(place.wrap(cmd, cfg), progress, 3600)
    line = next((ln for ln in lines if ln.startswith("WB-RESULT ")), None)
    if rc != 0 or line is None:
        why = next((ln[8:] for ln in lines if ln.startswith("WB-FAIL ")), output_tail(lines))
        raise SetupError(f"{place.label}: set-up failed, nothing recorded: {why}")
    got: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    if cuda and not got["cuda"]:
        raise SetupError(f"{place.label}: torch {got['torch']} sees no GPU (driver CUDA "
                         f"{node['cuda'] / 10}); set install.torch of {ref} to a cuXYZ the driver "
                         "supports")
    if got["workbench"] != here["workbench"] or release(got["torch"]) != release(here["torch"]):
        raise SetupError(f"{place.label}: got workbench {got['workbench']}, torch {got['torch']} "
                         f"instead of {here['workbench']}, {here['torch']}; set install.torch of "
                         f"{ref} to a build of {release(here['torch'])}")
    return got


def _copy(place: _Place, local: Path, remote: str) -> None:
    """``local``'s files into the folder ``remote`` there (tar over the transport, streamed)."""
    tar = subprocess.Popen(["tar", "-C", str(local), "-cf", "-", "."], stdout=subprocess.PIPE)
    q = shlex.quote(remote)
    rc, lines = place.stream(f"rm -rf {q} && mkdir -p {q} && tar -C {q} -xf -", lambda _: None,
                             1800, stdin=tar.stdout)
    tar.wait()
    if rc != 0 or tar.returncode != 0:
        raise SetupError(f"{place.label}: copying the wheels to {remote} failed: "
                         f"{output_tail(lines)}")
