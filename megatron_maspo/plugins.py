"""User hooks named in the config as ``"module:function"`` (a custom reward, a custom dataset).

The module is imported by its dotted name from an installed package or a folder on ``PYTHONPATH``
(``PYTHONPATH=. maspo train ...`` for a file next to the run; ``examples/`` shows both hooks). The working
directory itself is never searched implicitly (``python -m`` puts it first on ``sys.path``): a downloaded
run directory's ``config.yaml`` naming ``evil:f`` must not import an ``evil.py`` that happens to sit
where ``maspo`` is started (``docs/security.md``). Errors name the config field, so a typo costs one line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from megatron_maspo.errors import ConfigError

logger = logging.getLogger(__name__)

_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_target(text: str) -> bool:
    """Whether ``text`` has the ``module:function`` form (``pkg.mod:fn``)."""
    return _TARGET.fullmatch(text) is not None


def check_target(text: str, field: str) -> None:
    """Raise a ValueError naming ``field`` unless ``text`` has the ``module:function`` form."""
    if not is_target(text):
        raise ConfigError(f"{field}={text!r}: expected 'module:function', e.g. 'my_rewards:exact_match'")


def resolve(text: str, field: str) -> Callable[..., Any]:
    """Import ``module`` and return its callable ``function``.

    Raises:
        ValueError: malformed target, the module cannot be imported, or the attribute is missing or not
            callable (the message names ``field``).
    """
    check_target(text, field)
    module_name, attr = text.split(":")
    try:
        with without_cwd():
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}={text!r}: cannot import module {module_name!r} ({e}){_hint(module_name)}"
                          ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}={text!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _explicit_path() -> set[str]:
    """Folders named in ``PYTHONPATH`` (absolute): the user put them there on purpose."""
    return {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


@contextlib.contextmanager
def without_cwd() -> Iterator[None]:
    """Import with the working directory off ``sys.path`` unless ``PYTHONPATH`` names it."""
    cwd = os.getcwd()
    if cwd in _explicit_path():
        yield
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p and os.path.abspath(p) != cwd]
    try:
        yield
    finally:
        # Keep what the import itself added (a plugin extending sys.path), restore the cwd entries.
        added = [p for p in sys.path if p not in saved]
        sys.path[:] = saved + added


def _hint(module_name: str) -> str:
    """Why an import failed, when the module is a file in the working directory."""
    top = module_name.split(".")[0]
    if os.path.exists(f"{top}.py") or os.path.isdir(top):
        return (f"; {top} is in the working directory, which is not searched: run with PYTHONPATH=. "
                "(or its folder) if you trust it")
    return "; is its folder on PYTHONPATH?"


def plugin_fields(cfg: Any) -> list[tuple[str, str]]:
    """``[(field, "module:function")]`` of the user hooks a config names (grader, dataset function)."""
    found = []
    if cfg.reward.grader:
        found.append(("reward.grader", cfg.reward.grader))
    src = cfg.data.source
    if is_target(src) and not os.path.exists(src) and not src.startswith("reasoning_gym:"):
        found.append(("data.source", src))
    return found


def announce_plugins(cfg: Any, origin: str) -> None:
    """Say, before anything imports them, which user modules a config loaded from ``origin`` names."""
    for field, target in plugin_fields(cfg):
        module = target.split(":")[0]
        with without_cwd():
            spec = importlib.util.find_spec(module) if "." not in module else None
        where = f" from {spec.origin}" if spec is not None and spec.origin else ""
        logger.warning("%s names a plugin, %s=%s: importing module %r%s", origin, field, target, module,
                       where)
