"""What differs between the megatron-core versions this project runs on, in one place.

The rest of the package imports the differences from here instead of testing versions itself. Each
helper probes the installed megatron-core (a signature, an attribute), never its version string, so an
untested patch release that keeps the same API needs no change here. See ``docs/stack.md`` for the
survey these entries come from and the ones still to add.

Entries:

- **RoPE's MLA flag.** ``rope_utils._apply_rotary_pos_emb_bshd`` / ``_apply_rotary_pos_emb_thd`` take
  ``multi_latent_attention=`` on 0.16.1; 0.19 renamed it ``mla_rotary_interleaved=`` (the old name is kept
  as a deprecated keyword that warns) and ``apply_rotary_pos_emb`` passes only the new name to the thd
  function. :func:`rope_mla_kwargs` spells the flag for the installed version; :func:`pop_rope_mla_flag`
  reads it from a call made with either spelling.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

#: The old and new keyword of RoPE's MLA-style interleaving flag (0.16.1, then 0.19).
ROPE_MLA_OLD = "multi_latent_attention"
ROPE_MLA_NEW = "mla_rotary_interleaved"


@functools.cache
def rope_mla_kwarg() -> str:
    """The keyword the installed megatron-core's RoPE functions take for the MLA interleaving flag."""
    from megatron.core.models.common.embeddings import rope_utils

    params = inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters
    return ROPE_MLA_NEW if ROPE_MLA_NEW in params else ROPE_MLA_OLD


def rope_mla_kwargs(flag: bool) -> dict[str, bool]:
    """``{keyword: flag}`` for the installed megatron-core's ``_apply_rotary_pos_emb_*`` functions."""
    return {rope_mla_kwarg(): bool(flag)}


def pop_rope_mla_flag(kwargs: dict[str, Any], default: bool = False) -> bool:
    """The MLA interleaving flag of a RoPE call made with either spelling, removed from ``kwargs``.

    ``None`` counts as not given (0.19's default for the deprecated ``multi_latent_attention=``); when
    both are given, the old spelling wins, as it does inside megatron-core 0.19.
    """
    flag = default
    old = kwargs.pop(ROPE_MLA_OLD, None)
    new = kwargs.pop(ROPE_MLA_NEW, None)
    if new is not None:
        flag = new
    if old is not None:
        flag = old
    return bool(flag)
