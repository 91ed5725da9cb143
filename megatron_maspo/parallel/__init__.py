"""Parallelism: explicit process groups, CPU shims, vocab-parallel log-probs.

Public entries are imported lazily so ``import megatron_maspo.parallel`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_logprobs_from_hidden"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_maspo.parallel import logprobs

        return getattr(logprobs, name)
    raise AttributeError(name)
