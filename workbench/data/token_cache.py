"""The tokenised-data cache: which entry a run's data and tokenizer name, and its files.

An entry ``WORKBENCH_HOME/cache/tokenized/FINGERPRINT`` holds one prepared data set tokenised
(``train/``, ``validation/``, ``stats.json``); :func:`fingerprint` names it from the prepared
files' bytes, the loaded tokenizer and the tokenising settings. Loading the tokenizer needs
transformers (seconds to import), so for a built-in or local model :func:`files_key` names the
same entry from files alone (the sources' and the tokenizer files' bytes), remembered under
``by-files/KEY`` when the entry is stored: a repeated launch, and the planner, find it without a
tokenizer. Entries are written whole or not at all (a rename), and linked into run directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from workbench.data.stats import TokenStats
from workbench.spec import RunSpec

SPLITS = ("train", "validation")
_VERSION = "2"  # bump when tokenisation changes, so cached results are not reused


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else
             json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for part in (tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                 tokenizer.pad_token):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()


def fingerprint(spec: RunSpec, data_dir: Path, tokenizer: Any) -> str:
    h = hashlib.sha256(f"v{_VERSION}".encode())
    for split in SPLITS:
        path = data_dir / f"{split}.jsonl"
        h.update(f"\0{split}\0".encode())
        if path.is_file():
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    d = spec.data
    h.update(json.dumps([tokenizer_fingerprint(tokenizer), d.max_length, d.truncation,
                         d.packing]).encode())
    return h.hexdigest()[:24]


# Files of a model folder that hold weights, not tokenizer or config: left out of files_key.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                    ".onnx", ".npz")


def files_key(spec: RunSpec) -> str | None:
    """A key for what :func:`fingerprint` would give, from files only: the prepared data's key
    (its sources' bytes and settings), every non-weight file of the model folder (what
    AutoTokenizer reads), the tokenising settings and the versions of what turns them into
    tokens. None for a hub model, remote code or a hub dataset (the tokenizer is loaded then)."""
    from importlib.metadata import PackageNotFoundError, version

    from workbench.data.prepare import sources_key
    from workbench.data.tokenize import FALLBACK_CHAT_TEMPLATE
    from workbench.errors import WorkbenchError
    from workbench.spec.models import resolve_model

    if spec.model.trust_remote_code:
        return None
    try:
        folder = Path(resolve_model(spec.model.id))
    except WorkbenchError:
        return None
    data_key = sources_key(spec)
    if data_key is None or not folder.is_dir():
        return None
    try:
        libs = [version("transformers"), version("tokenizers")]
    except PackageNotFoundError:
        return None
    h = hashlib.sha256(json.dumps([_VERSION, data_key, libs, FALLBACK_CHAT_TEMPLATE,
                                   spec.data.max_length, spec.data.truncation,
                                   spec.data.packing]).encode())
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            h.update(f"\0{path.name}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:24]


def _by_files(key: str) -> Path:
    return cache_root() / "by-files" / key


def cached_stats(key: str | None) -> TokenStats | None:
    """The statistics of the cache entry :func:`files_key` ``key`` names, if it is complete."""
    if key is None or not _by_files(key).is_file():
        return None
    entry = cache_root() / _by_files(key).read_text(encoding="utf-8").strip()
    if not (entry / "stats.json").is_file():
        return None
    return TokenStats.from_dict(json.loads((entry / "stats.json").read_text(encoding="utf-8")))


def remember(key: str | None, fp: str) -> None:
    if key is None:
        return
    path = _by_files(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{key}.tmp{os.getpid()}")
    tmp.write_text(fp, encoding="utf-8")
    tmp.replace(path)  # atomic: a reader sees a whole fingerprint or none


def cache_root() -> Path:
    from workbench.runs.home import home

    return home() / "cache" / "tokenized"


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link (or copy, across filesystems) every file of ``src`` into ``dst``."""
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def store(out: Path, cached: Path) -> None:
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        link_tree(out, tmp)
        tmp.rename(cached)  # atomic: a reader sees a complete entry or none
    except OSError:  # another launch stored the same fingerprint first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
