"""GRPO rewards: the built-in rule rewards, a user's ``module:function``, and their checks.

A reward scores every sampled completion; TRL calls it as
``fn(prompts=..., completions=..., **columns)`` with the batch's data columns as lists, and logs
each one as ``rewards/<name>/mean`` and ``/std``. Built-ins (configured by ``method.rewards``):

  exact_match  1.0 when the completion's first word equals the ``column`` value (case and
               trailing punctuation ignored), else 0.0
  contains     1.0 when the completion contains the ``column`` value (case ignored)
  regex        1.0 when ``pattern`` matches the completion (re.search), else 0.0
  length       1.0 at ``target_chars`` characters, falling linearly to 0.0 at 0 or twice that

:func:`check_rewards` runs at launch, before any process starts: it imports each user function,
checks it is callable with TRL's keyword call, and checks that each built-in's column is in the
data, raising :class:`~workbench.errors.RewardError` otherwise. :func:`ship_rewards` then copies
each user reward's module (a ``.py`` file, or its top-level package folder) into the run
directory (``data/rewards/``), which travels to every target with the run; the ranks put that
folder first on ``sys.path`` (:func:`use_shipped_rewards`), so they import the very code that
was checked, wherever they run.

    >>> fn = build_reward(RewardSpec(fn="exact_match"))
    >>> fn(prompts=[None, None], completions=["Moo.", "woof"], answer=["moo", "moo"])
    [1.0, 0.0]
"""

from __future__ import annotations

import importlib
import inspect
import re
import shutil
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workbench.errors import RewardError
from workbench.spec.sections import BUILTIN_REWARDS, RewardSpec

RewardFn = Callable[..., list[float]]
_COLUMN_REWARDS = ("exact_match", "contains")
SHIPPED_DIR = "rewards"  # under RUN_DIR/data: the user reward modules copied there at launch
_SHIP_LIMIT = 16 << 20  # bytes: more is a library to install on the target, not a reward file


def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes conversational completions as message lists."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _first_word(text: str) -> str:
    words = text.strip().split()
    return words[0].strip(".,!?;:\"'").lower() if words else ""


def build_reward(r: RewardSpec) -> RewardFn:
    """The callable TRL gets for one ``method.rewards`` entry (named for TRL's logged keys)."""
    if r.fn not in BUILTIN_REWARDS:
        return load_user_reward(r.fn)
    if r.fn in _COLUMN_REWARDS:
        column, exact = r.column, r.fn == "exact_match"

        def by_column(completions: Sequence[Any], **kw: Any) -> list[float]:
            refs = kw[column]
            out = []
            for c, ref in zip(completions, refs):
                text, want = completion_text(c), str(ref).strip().lower()
                ok = _first_word(text) == want if exact else want in text.lower()
                out.append(1.0 if ok else 0.0)
            return out

        fn: RewardFn = by_column
    elif r.fn == "regex":
        pattern = re.compile(r.pattern or "")

        def by_regex(completions: Sequence[Any], **kw: Any) -> list[float]:
            return [1.0 if pattern.search(completion_text(c)) else 0.0 for c in completions]

        fn = by_regex
    else:
        target = float(r.target_chars or 1)

        def by_length(completions: Sequence[Any], **kw: Any) -> list[float]:
            return [max(0.0, 1.0 - abs(len(completion_text(c)) - target) / target)
                    for c in completions]

        fn = by_length
    fn.__name__ = r.fn
    return fn


def load_user_reward(ref: str) -> RewardFn:
    """Import ``module:function`` and check TRL can call it; :class:`RewardError` if not."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or the module's own error while importing
        raise RewardError(
            f"reward {ref!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "put its folder on this Python's path (PYTHONPATH or sys.path) or fix it; launch "
            "copies it to the training nodes") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward {ref!r}: module {module_name!r} has no {attr!r}; check the "
                          "name after the colon")
    if not callable(fn):
        raise RewardError(f"reward {ref!r} is a {type(fn).__name__}, not a function; give a "
                          "function def f(completions, **kwargs) -> list[float]")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn  # a builtin or C callable: nothing to inspect, TRL will call it
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    required = {p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not takes_any or not required <= {"prompts", "completions"} or not (
            "completions" in names or takes_any):
        raise RewardError(
            f"reward {ref!r} has signature {inspect.signature(fn)}, which TRL cannot call: it "
            "passes prompts=, completions= and every data column as keywords; define it as "
            "def f(completions, **kwargs) -> list[float]")
    return fn


def check_rewards(rewards: Sequence[RewardSpec], columns: set[str]) -> list[RewardFn]:
    """Build every reward and check the columns the built-ins read exist in the data."""
    for r in rewards:
        if r.fn in _COLUMN_REWARDS and r.column not in columns:
            raise RewardError(
                f"reward {r.fn} reads column {r.column!r}, which the data does not have (columns: "
                f"{', '.join(sorted(columns - {'prompt'})) or 'none besides prompt'}); set "
                "method.rewards[].column or add the column")
    return [build_reward(r) for r in rewards]


def _installed(path: Path) -> bool:
    """Inside this Python installation (stdlib, site-packages): the target's environment has it,
    as it has workbench; such a module is not copied."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(path.is_relative_to(Path(r).resolve()) for r in roots)


def ship_rewards(rewards: Sequence[RewardSpec], dest: Path) -> list[str]:
    """Copy each user reward's top-level module into ``dest`` (after :func:`check_rewards`
    imported it); returns what was copied. :class:`RewardError` for a module that is not a plain
    ``.py`` file or a package folder of them (a compiled extension, a namespace package, a zip),
    or one too big to travel with every run."""
    shipped: list[str] = []
    for r in rewards:
        if r.fn in BUILTIN_REWARDS:
            continue
        top = r.fn.partition(":")[0].split(".")[0]
        module = importlib.import_module(top)
        file = getattr(module, "__file__", None)
        is_package = hasattr(module, "__path__")
        where = Path(file).resolve() if file else None
        if where is None or where.suffix != ".py" or (
                is_package and where.name != "__init__.py"):
            raise RewardError(
                f"reward {r.fn!r}: module {top!r} is not a plain .py file or package folder "
                f"({where or 'it has no file: a namespace package, built-in or zip import'}), so it "
                "cannot be copied to the training nodes; make it a .py file (or a folder with "
                "__init__.py), or install it in the target's environment (pip install)")
        if _installed(where) or top in shipped:
            continue
        source = where.parent if is_package else where
        files = [p for p in (source.rglob("*") if is_package else [source]) if p.is_file()
                 and "__pycache__" not in p.parts]
        size = sum(p.stat().st_size for p in files)
        if size > _SHIP_LIMIT:
            raise RewardError(
                f"reward {r.fn!r}: module {top!r} ({source}) is {size / 2**20:.0f} MiB, too big to "
                "copy with every run; install it in the target's environment (pip install) or "
                "keep the reward in a small file of its own")
        dest.mkdir(parents=True, exist_ok=True)
        if is_package:
            shutil.copytree(source, dest / top,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / source.name)
        shipped.append(top)
    return shipped


def use_shipped_rewards(data_dir: Path) -> None:
    """On a rank: import user rewards from the copies launch shipped with the run, ahead of
    whatever the node's own path holds."""
    shipped = data_dir / SHIPPED_DIR
    if shipped.is_dir() and str(shipped) not in sys.path:
        sys.path.insert(0, str(shipped))
