"""User hooks named in the config as ``"module:function"`` (a custom reward, a custom dataset).

The module is imported by its dotted name, so it must be importable from where ``maspo`` runs: an
installed package, or a file in the working directory or on ``PYTHONPATH`` (``examples/`` shows both
hooks). Errors name the config field, so a typo costs one line, not a traceback from deep in a run.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from megatron_maspo.errors import ConfigError

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
    # The `maspo` console script does not put the working directory on sys.path (python -m does); a
    # user's my_rewards.py next to the run should import either way. Appended: never shadows a package.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}={text!r}: cannot import module {module_name!r} ({e}); is its folder "
                         f"the working directory or on PYTHONPATH?") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}={text!r}: module {module_name!r} has no callable {attr!r}")
    return fn
