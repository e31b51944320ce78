"""GGUF files through llama.cpp's own tools: set-up, the architecture check, convert, quantise, run.

llama.cpp comes from one place, the ``llama-cpp-python`` source package (:data:`LLAMA_CPP_PYTHON`):
its wheel (built once by pip and kept in pip's wheel cache) gives the library that quantises and
runs GGUF files, and its sdist vendors ``convert_hf_to_gguf.py`` with its ``conversion`` and
``gguf-py`` packages, unpacked once into :func:`tools_dir`. ``python -m workbench.serve.gguf setup``
(``make export-deps``) does both. Every tool runs in a child process, so a crash in C code ends
that process and not the kernel; the children print JSON lines (``{"progress": ...}`` and one
``{"result": ...}``) that :func:`_child` reads.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workbench.errors import ExportError

LLAMA_CPP_PYTHON = "0.3.36"
SETUP_HOW = "run `make export-deps` (or `python -m workbench.serve.gguf setup`)"
# What llama_model_quantize can write from an f16 file (the names llama-quantize takes).
QUANT_TYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_m": 12,
               "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
FLOAT_TYPES = ("f16", "bf16", "f32")  # written by the converter itself


def tools_dir() -> Path:
    """Where the converter lives: ``WORKBENCH_LLAMA_CPP``, else the user's cache."""
    if os.environ.get("WORKBENCH_LLAMA_CPP"):
        return Path(os.environ["WORKBENCH_LLAMA_CPP"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "workbench" / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def missing_tools() -> list[str]:
    """What GGUF export lacks here (empty when it can run)."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append(f"llama-cpp-python {LLAMA_CPP_PYTHON} (quantise and run GGUF)")
    if not (tools_dir() / "convert_hf_to_gguf.py").is_file():
        missing.append(f"llama.cpp's convert_hf_to_gguf.py in {tools_dir()}")
    for module in ("sentencepiece",):
        if importlib.util.find_spec(module) is None:
            missing.append(module)
    return missing


def require_tools() -> None:
    missing = missing_tools()
    if missing:
        raise ExportError(f"GGUF export needs {', '.join(missing)}: {SETUP_HOW}")


def setup(jobs: int = 2, echo: Callable[[str], None] = print) -> Path:
    """Install llama-cpp-python (pip builds its wheel once, then reuses its wheel cache) and
    unpack the converter from the same source package; return the converter's folder."""
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get(
        "CMAKE_BUILD_PARALLEL_LEVEL", str(jobs))}
    pip = [sys.executable, "-m", "pip"]
    echo(f"llama-cpp-python {LLAMA_CPP_PYTHON}: pip install (a first build compiles llama.cpp)")
    subprocess.run([*pip, "install", "-q", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "sentencepiece"], check=True, env=env)
    dest = tools_dir()
    if (dest / "convert_hf_to_gguf.py").is_file():
        echo(f"converter: {dest} (already unpacked)")
        return dest
    with tempfile.TemporaryDirectory(prefix="wb-llama-sdist-") as tmp:
        subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True, env=env)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        unpack_converter(sdist, dest)
    echo(f"converter: {dest}")
    return dest


def unpack_converter(sdist: Path, dest: Path) -> None:
    """Copy convert_hf_to_gguf.py, conversion/ and gguf-py/ out of the sdist, all or nothing."""
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            _, sep, rest = m.name.partition("/vendor/llama.cpp/")
            if sep and rest.startswith(wanted) and (m.isfile() or m.isdir()):
                m.name = rest
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    if not (tmp / "convert_hf_to_gguf.py").is_file():
        raise ExportError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    tmp.rename(dest)


def supported_architectures() -> dict[str, str]:
    """The converter's architectures (config.json ``architectures`` -> its model family), read
    from its source without importing it (that imports torch)."""
    source = (tools_dir() / "conversion" / "__init__.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP":
            value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            return {str(k): str(v) for k, v in value.items()}
    raise ExportError(f"{tools_dir()}/conversion/__init__.py has no TEXT_MODEL_MAP")


def check_convertible(model_dir: Path) -> str:
    """Refuse, before any work, a model whose architecture llama.cpp's converter cannot write;
    return the architecture."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    archs = config.get("architectures") or []
    known = supported_architectures()
    for arch in archs:
        if arch in known:
            return str(arch)
    raise ExportError(
        f"llama.cpp's converter (llama-cpp-python {LLAMA_CPP_PYTHON}) cannot convert "
        f"{', '.join(archs) or 'a model without config.json architectures'} to GGUF: it is not "
        f"among its {len(known)} architectures; export format 'merged' still works")


def check_quant(names: Sequence[str]) -> list[str]:
    out = [n.strip().lower() for n in names if n.strip()]
    bad = [n for n in out if n not in FLOAT_TYPES and n not in QUANT_TYPES]
    if bad:
        raise ExportError(f"unknown GGUF type {', '.join(bad)}; choose from "
                          f"{', '.join([*FLOAT_TYPES, *QUANT_TYPES])}")
    return out


# -- running the tools (each in a child process) --------------------------------------------------
def _child(args: list[str], progress: Callable[[str], None] | None, what: str) -> Any:
    cmd = [sys.executable, "-m", "workbench.serve.gguf", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result: Any = None
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("{"):
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "result" in msg:
                result = msg["result"]
                continue
            if isinstance(msg, dict) and "progress" in msg:
                if progress:
                    progress(str(msg["progress"]))
                continue
        tail = (tail + [line])[-25:]
        if progress and line.startswith("INFO:hf-to-gguf:Model successfully"):
            progress(line.split(":", 2)[-1])
    if proc.wait() != 0 or result is None:
        raise ExportError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return result


def convert(model_dir: Path, out_file: Path, outtype: str = "f16",
            progress: Callable[[str], None] | None = None) -> Path:
    """``model_dir`` (HF layout) to one GGUF file with llama.cpp's convert_hf_to_gguf.py."""
    _child(["convert", str(tools_dir()), str(model_dir), "--outfile", str(out_file),
            "--outtype", outtype], progress, f"convert_hf_to_gguf.py ({outtype})")
    return out_file


def quantize(src: Path, dst: Path, qtype: str,
             progress: Callable[[str], None] | None = None) -> Path:
    """``src`` (an f16/f32 GGUF) quantised to ``qtype`` with llama.cpp's llama_model_quantize."""
    _child(["quantize", str(src), str(dst), qtype], progress, f"llama.cpp quantize {qtype}")
    return dst


def generate(gguf_file: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             texts: Sequence[str] = ()) -> dict[str, Any]:
    """Greedy tokens llama.cpp generates after each prompt (given as token ids), and its own
    tokenisation of ``texts``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": [list(p) for p in prompts], "texts": list(texts),
                   "max_new_tokens": max_new_tokens}, f)
    try:
        return dict(_child(["generate", str(gguf_file), f.name], None, f"llama.cpp on {gguf_file}"))
    finally:
        os.unlink(f.name)


def _emit(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


def _convert_main(conv: Path, argv: list[str]) -> None:
    """Run convert_hf_to_gguf.py; a BPE tokenizer whose pre-tokenizer is plain byte-level GPT-2
    (the regex, no normaliser) but whose hash the converter does not list is written as 'gpt-2',
    which is what that pre-tokenizer is (the tiny built-in model's tokenizer is one)."""
    import runpy

    sys.path[:0] = [str(conv), str(conv / "gguf-py")]
    from conversion import base  # type: ignore[import-not-found]

    listed = base.TextModel.get_vocab_base_pre

    def pre(self: Any, tokenizer: Any) -> str:
        try:
            return str(listed(self, tokenizer))
        except NotImplementedError:
            tok = json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8"))
            pre_tok = tok.get("pre_tokenizer") or {}
            if (pre_tok.get("type") == "ByteLevel" and pre_tok.get("use_regex", True)
                    and not tok.get("normalizer")):
                _emit(progress="tokenizer: plain byte-level BPE, written as llama.cpp's 'gpt-2'")
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = pre
    script = conv / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    _emit(result="ok")


def _quantize_main(src: str, dst: str, qtype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[qtype]
    params.nthread = max(1, min(os.cpu_count() or 1, 8))
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    _emit(result="ok")


def _generate_main(gguf_file: str, request: str) -> None:
    import llama_cpp
    import llama_cpp.llama as llama_module

    # Weight repacking (llama.cpp's "extra buffer types") only re-lays weights for speed; in
    # 0.3.36 it crashed on a q8_0 file on an AMX CPU, so the check runs without it.
    defaults = llama_module.llama_cpp.llama_model_default_params

    def no_repack() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = no_repack
    req = json.loads(Path(request).read_text(encoding="utf-8"))
    llm = llama_cpp.Llama(model_path=gguf_file, n_ctx=512, n_threads=2, seed=0, verbose=False)
    eos = llm.token_eos()
    outs = []
    for prompt in req["prompts"]:
        llm.reset()
        got: list[int] = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if tok == eos:
                break
            got.append(int(tok))
            if len(got) >= req["max_new_tokens"]:
                break
        outs.append(got)
    tokenised = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in req["texts"]]
    # Whether llama.cpp puts BOS before a prompt itself (then a chat template must not).
    add_bos = llm.tokenize(b"a", add_bos=True, special=False)[:1] == [llm.token_bos()]
    llm.close()
    _emit(result={"tokens": outs, "tokenised": tokenised, "eos": eos, "add_bos": add_bos})


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args.pop(0) if args else "help"
    if cmd == "setup":
        setup(jobs=int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 2))
    elif cmd == "convert":
        _convert_main(Path(args[0]), args[1:])
    elif cmd == "quantize":
        _quantize_main(*args)
    elif cmd == "generate":
        _generate_main(*args)
    else:
        raise SystemExit("usage: python -m workbench.serve.gguf setup|convert|quantize|generate")


if __name__ == "__main__":
    main()
