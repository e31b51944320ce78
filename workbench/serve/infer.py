"""Local generation with transformers (+ peft): the reference that served output is compared with.

    >>> chat = load_chat_model("builtin:tiny-llama")          # doctest: +SKIP
    >>> chat.generate(["What does a cow say?"])               # doctest: +SKIP
    ['moo']
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ChatModel:
    """A tokenizer + model pair that answers single-turn prompts greedily (deterministic)."""

    def __init__(self, model: Any, tokenizer: Any, name: str) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name

    def __repr__(self) -> str:
        return f"ChatModel({self.name!r})"

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 16,
                 batch_size: int = 32) -> list[str]:
        import torch

        tok = self.tokenizer
        out: list[str] = []
        tok.padding_side = "left"  # decoder-only generation wants the prompt flush right
        for i in range(0, len(prompts), batch_size):
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
                     for p in prompts[i:i + batch_size]]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                gen = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=tok.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
        return out

    __call__ = generate


def _loading(model: str) -> Any:
    """Around loading ``model``: a small one (under 1 GB of weights, a second or so) shows no
    progress bar above a notebook's output; a large one keeps transformers' bar."""
    import contextlib

    from workbench.train.quiet import no_progress_bars

    folder = Path(model)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
    return no_progress_bars() if folder.is_dir() and size < 1e9 else contextlib.nullcontext()


def load_chat_model(source: Any) -> ChatModel:
    """Load a base model id/folder, a run's artefact folder (adapter or full model), or a Job."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data.tokenize import ensure_chat_template
    from workbench.spec.models import resolve_model

    if hasattr(source, "run_dir"):  # a Job
        art = source.run_dir.artefact_dir()
        if art is None:
            from workbench.errors import WorkbenchError

            raise WorkbenchError(
                f"run {source.id} has no adapter/ or model/ yet (state {source.state}); wait for "
                "it to succeed"
            )
        source = art
    path = Path(str(source))
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        from workbench.serve.sources import require_adapter_weights

        require_adapter_weights(path)

        meta = json.loads((path / "workbench.json").read_text()) if (
            path / "workbench.json").is_file() else {}
        cfg = json.loads((path / "adapter_config.json").read_text())
        base = meta.get("base_model") or cfg["base_model_name_or_path"]
        with _loading(resolve_model(str(base))):
            model: Any = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                                   str(path))
        tok = AutoTokenizer.from_pretrained(str(path))
        name = str(path)
    else:
        resolved = resolve_model(str(source))
        with _loading(resolved):
            model = AutoModelForCausalLM.from_pretrained(resolved)
        tok = AutoTokenizer.from_pretrained(resolved)
        name = str(source)
    ensure_chat_template(tok)
    return ChatModel(model, tok, name)
