"""The server process: the exact vLLM command and environment, and the guard's command line.

``deploy`` runs vLLM under a small guard process (:mod:`workbench.serve.guard`) on the target;
this module writes both command lines, picks free ports, and reads the server's log: its latest
line (deploy's progress) and, when it failed, which typed error it was (port taken, no vLLM,
LoRA rank, head size, or just its log tail).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.errors import (
    DeployError,
    EndpointStartError,
    LoraRankError,
    PortInUseError,
    ServingEnvironmentError,
    UnsupportedModelError,
)
from workbench.serve.sources import _looks_like_hub_id

if TYPE_CHECKING:
    from workbench.serve.sources import ServePlan

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
PORT_FROM_GUARD = "@PORT@"  # in a server command: the port the guard picked on its machine
# ``python -m workbench.serve`` is the guard (workbench/serve/__main__.py): older and newer
# workbench installs on a target answer to the same command.
GUARD = ("-m", "workbench.serve", "--guard")


def guard_command(python: str, server_dir: str, host: str, port: int, watch: str,
                  vllm: list[str], gpus: int = 0) -> list[str]:
    """The guard's command line; ``watch`` is ``--watch-pid N`` / ``--watch-stdin`` / ``""``;
    ``gpus`` > 0 makes the guard lease that many of its machine's cards for the server."""
    return [python, *GUARD, server_dir, "--host", host, "--port", str(port), *watch.split(),
            *(["--gpus", str(gpus)] if gpus else []), "--", *vllm]


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def vllm_command(python: str, plan: ServePlan, host: str, port: int | str, max_model_len: int,
                 max_lora_rank: int | None, on_cpu: bool, workdir: Path,
                 extra_args: Sequence[str] = (), server_dir: str | None = None) -> list[str]:
    """The exact vLLM command line (also what the benchmark starts by hand).

    Files it needs (the chat template) are written into ``workdir``; ``server_dir`` is that
    folder as the server sees it, when it runs elsewhere. ``port`` may be PORT_FROM_GUARD.
    """
    cmd = [python, "-m", VLLM_MODULE, "--model", plan.model, "--served-model-name",
           plan.model_name, "--host", host, "--port", str(port),
           "--max-model-len", str(max_model_len), "--distributed-executor-backend", "uni"]
    hub_id = not plan.model.startswith(("/", "~", ".")) and not Path(plan.model).is_dir()
    if plan.revision and hub_id:  # the commit of the base the runs trained on
        cmd += ["--revision", plan.revision]
    if plan.trust_remote_code:
        cmd += ["--trust-remote-code"]
    if on_cpu:
        # float32 matches transformers on CPU token for token; eager skips minutes of compiling.
        cmd += ["--dtype", "float32", "--enforce-eager"]
    if plan.chat_template:
        (workdir / "chat_template.jinja").write_text(plan.chat_template, encoding="utf-8")
        cmd += ["--chat-template", f"{server_dir or workdir}/chat_template.jinja"]
    if max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank),
                "--max-loras", str(max(1, len(plan.adapters))),
                "--lora-modules", *[f"{a.name}={a.path}" for a in plan.adapters]]
    return cmd + list(extra_args)


def vllm_env(plan: ServePlan, server_dir: str | Path, on_cpu: bool) -> dict[str, str]:
    """What workbench adds to the server's environment (the target supplies the rest).

    No API key: the guard reads it from the endpoint folder's ``api_key`` file and passes it to
    vLLM in its environment, so it is never on a command line (``ps``) or in command.json.
    """
    d = str(server_dir)
    env = {
        # One process, no engine core subprocess: the fastest start on a small machine, and one
        # PID to stop.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": f"{d}/cache", "XDG_CACHE_HOME": f"{d}/cache",
        "TORCHINDUCTOR_CACHE_DIR": f"{d}/cache/inductor",
        "TMPDIR": f"{d}/tmp", "PYTHONUNBUFFERED": "1",
        # Adapters can be added to a running server (Endpoint.add_adapter).
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }
    if not _looks_like_hub_id(plan.model):
        env["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub, and must not wait for one
    if on_cpu:  # GiB: plenty for short test prompts
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor moves of a log written to a tty


def _last_log_line(path: Path) -> str:
    """The log's latest line without colour codes and vLLM's level/time/source prefix, for a
    progress line."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            text = _ANSI.sub("", fh.read().decode("utf-8", "replace"))
            lines = [ln for ln in text.splitlines() if ln.strip()]
    except OSError:
        return ""
    text = re.sub(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|DEBUG) [\d-]+ [\d:.]+ \[[^]]+\] ", "",
                  lines[-1]) if lines else ""
    return text[:70]


def _classify_failure(name: str, log: str, why: str | None) -> DeployError:
    tail = "\n".join(log.splitlines()[-25:])
    if "Address already in use" in log:
        return PortInUseError(f"endpoint {name}: its port was taken while vLLM started; deploy "
                              f"again (without port= a free one is picked).\n{tail}")
    if "No module named 'vllm" in log or "No module named vllm" in log:
        return ServingEnvironmentError(f"endpoint {name}: the serving Python has no working vLLM; "
                                       f"run `make serve-env` or set WORKBENCH_SERVE_PYTHON.\n{tail}")
    if "max_lora_rank" in log or "LoRA rank" in log:
        return LoraRankError(f"endpoint {name}: vLLM refused an adapter's rank; deploy with a "
                             f"larger max_lora_rank.\n{tail}")
    if "head size" in log.lower() or "head_size" in log:
        return UnsupportedModelError(f"endpoint {name}: vLLM cannot serve this model's head "
                                     f"size here.\n{tail}")
    what = why or "the server exited during start-up"
    return EndpointStartError(f"endpoint {name}: {what}; its log ends with:\n{tail}\n"
                              "(full log: workbench.serve.get_endpoint(NAME).logs(None))")
