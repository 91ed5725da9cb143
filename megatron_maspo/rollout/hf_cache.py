"""One transformers forward call with a KV cache, passed and read back under the name the installed
release uses.

transformers 5.24 renamed the forward argument and the output field ``past_key_values`` to ``cache``.
The old names still work there, but each use logs "`past_key_values`/`cache_params` are deprecated"
through transformers' logger (a log record, not a Python warning: warning filters do not catch it).
Releases before the rename (down to 4.51, the oldest the pins allow) accept only ``past_key_values``.
So the name is taken from the model's own ``forward`` signature, not from a version number: a model
class that is late or early to the rename is called the way it declares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def _cache_name(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(model: torch.nn.Module) -> str:
    """``"cache"`` when ``model.forward`` declares it (transformers >= 5.24), else ``"past_key_values"``."""
    return _cache_name(type(model))


def forward_with_cache(model: torch.nn.Module, cache: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``model(**kwargs)`` with ``cache`` under the installed argument name.

    Returns:
        the model output and its cache (read from the output field of the same name).
    """
    name = cache_argument(model)
    out = model(**kwargs, **{name: cache})
    return out, getattr(out, name)
