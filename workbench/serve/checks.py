"""The checks that refuse a deploy before anything starts: LoRA ranks, head sizes, image models
the serving Python cannot read, ports.

Each raises a typed :class:`~workbench.errors.DeployError` whose message says what to pass
instead, so a deploy that cannot work fails in the cell that asked for it, not minutes later in a
server log.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import LoraRankError, PortInUseError, UnsupportedModelError
from workbench.serve.sources import Adapter, _read_json

# vLLM's CPU attention kernels exist for these head sizes only; others crash on the first request.
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
# --max-lora-rank accepts only these values (vLLM's LoRAConfig).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _max_lora_rank(adapters: Sequence[Adapter], requested: int | None) -> int | None:
    if not adapters:
        return None
    need = max(a.rank for a in adapters)
    if requested is None:
        fits = [r for r in LORA_RANKS if r >= need]
        if not fits:
            raise LoraRankError(f"adapter rank {need} is above the largest vLLM serves "
                                f"({LORA_RANKS[-1]}); train with a lower method.lora_r")
        return fits[0]
    if requested not in LORA_RANKS:
        raise LoraRankError(f"max_lora_rank {requested} is not one vLLM accepts; use one of "
                            f"{', '.join(map(str, LORA_RANKS))}")
    check_lora_rank(adapters, requested)
    return requested


def check_lora_rank(adapters: Sequence[Adapter], max_rank: int) -> None:
    for a in adapters:
        if a.rank > max_rank:
            raise LoraRankError(
                f"adapter {a.name!r} ({a.path}) has LoRA rank {a.rank}, above the server's "
                f"max_lora_rank {max_rank}; deploy with max_lora_rank="
                f"{next((r for r in LORA_RANKS if r >= a.rank), a.rank)} (or more)"
            )


def check_head_size(model: str, on_cpu: bool) -> None:
    cfg = _read_json(Path(model) / "config.json")
    if not cfg or not on_cpu:
        return  # a hub id, or a GPU backend: vLLM itself knows best
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise UnsupportedModelError(
            f"model {model} has attention head size {head_dim}; vLLM's CPU backend serves only "
            f"{', '.join(map(str, sorted(CPU_HEAD_SIZES)))}. Use a model whose hidden_size / "
            "num_attention_heads is one of those, or deploy to a GPU target"
        )


def check_reads_images(model: str, python: str, probed: dict[str, Any]) -> None:
    """A vision-language model needs torchvision where vLLM runs: transformers builds its image
    and video processors with it, and the server fails at start-up without it."""
    from workbench.spec.models import is_vision_model

    if probed.get("torchvision", True) or not is_vision_model(model, local_only=True):
        return
    raise UnsupportedModelError(
        f"model {Path(model).name} reads images, and vLLM builds its image processor with "
        f"torchvision, which the serving Python {python} does not have (`make serve-env` "
        "removes the CUDA-linked one a CPU machine cannot load); install the torchvision build "
        "of its torch there, or deploy to a GPU target whose vLLM has it")


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({exc.strerror}); pass another port= "
                "or leave port unset to pick a free one (`workbench endpoints` lists endpoints)"
            ) from None
