"""What looks secret, and how a secret stays out of run files, printed output and error texts.

One place decides what is secret: an environment variable whose name says so (TOKEN, KEY,
SECRET, PASSWORD, CREDENTIAL, AUTH) or a value shaped like a token (hf_..., sk-..., AKIA...).
:func:`scrub` masks such values in any text (reproduce.zip, printed scripts, error messages).
A target's secret ``env`` entries travel to the job in an env file readable only by its owner,
kept beside (never inside) the run directory, which the job script sources; the script and
every message show ``NAME=***`` instead.

    >>> split_env({"HF_HOME": "/scratch/hf", "HF_TOKEN": "hf_abcdefghijklmnopqrstu"})[1]
    {'HF_TOKEN': 'hf_abcdefghijklmnopqrstu'}
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
_SECRET_SHAPES = [
    re.compile(r"\bhf_[A-Za-z0-9]{16,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"(?i)\b(password|passwd|token|secret|api[_-]?key)(\s*[=:]\s*)(\S+)"),
]
MASK = "***"


def is_secret(name: str, value: str) -> bool:
    """Whether the variable ``name=value`` holds a secret (by its name or by its value's shape)."""
    return bool(_SECRET_NAME.search(name)) or any(p.search(value) for p in _SECRET_SHAPES[:3])


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """The secret values in ``environ`` (default: this process's), longest first, for scrub."""
    env = os.environ if environ is None else environ
    return sorted({v for k, v in env.items() if is_secret(k, v) and len(v) >= 6},
                  key=len, reverse=True)


def scrub(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with ``secrets`` (default: this process's secret values) and token-shaped strings
    replaced by ``***``."""
    for value in secret_values() if secrets is None else secrets:
        text = text.replace(value, MASK)
    for pattern in _SECRET_SHAPES:
        if pattern.groups == 3:
            text = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
        else:
            text = pattern.sub(MASK, text)
    return text


def split_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as (plain, secret): plain entries may be shown and written anywhere."""
    plain = {k: v for k, v in env.items() if not is_secret(k, v)}
    return plain, {k: v for k, v in env.items() if k not in plain}


def remote_quote(path: str) -> str:
    """``path`` quoted for a remote shell, with a leading ``~/`` still expanding there."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def env_file_path(run_dir: str) -> str:
    """Where the secret env file of the run in ``run_dir`` lives on the machine that runs it:
    beside the run directory (same shared filesystem), never inside it, so no copy, sync or
    bundle of the run directory carries it."""
    d = PurePosixPath(run_dir.rstrip("/"))
    return str(d.parent / ".secrets" / f"{d.name}.env")


def env_file_text(secret: dict[str, str]) -> str:
    """The env file's content: one ``export NAME=value`` line per secret, for ``bash`` to source."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in secret.items())


def write_secret_env(transport: Any, env: dict[str, str], run_dir: str) -> str | None:
    """Write the secret entries of ``env`` to ``env_file_path(run_dir)`` on the machine
    ``transport`` (a workbench.targets.backends.remote Transport) reaches, readable only by its owner
    (0600 in a 0700 folder, so from the start); its path, or None when nothing is secret.

    Any job script that sources that path gets the variables (slurm.sbatch, serve.sbatch)."""
    secret = split_env(env)[1]
    if not secret:
        return None
    path = env_file_path(run_dir)
    q, folder = remote_quote(path), remote_quote(str(PurePosixPath(path).parent))
    transport.run(f"umask 077 && mkdir -p {folder} && chmod 700 {folder} && cat > {q}.tmp "
                  f"&& mv -f {q}.tmp {q}", input=env_file_text(secret).encode(), timeout=60)
    return path
