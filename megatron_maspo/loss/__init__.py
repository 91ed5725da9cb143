"""Policy-loss family: MASPO, the GRPO family and a QUATRO reconstruction (pure PyTorch).

Entries: `token_losses` (per-token loss by method name), `compute_policy_loss` (the trainer's entry
with regularisers, aggregation and metrics, taking one `LossInputs`), `compute_advantages` (group
estimators). See
docs/losses.md for the method table and metric keys. No megatron import in this package.

The entries load on first use, so ``megatron_maspo.loss.config`` (read by the CLI to check a
``--set`` before anything runs) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_maspo.loss.advantages import compute_advantages
    from megatron_maspo.loss.config import LossConfig
    from megatron_maspo.loss.inputs import LossInputs
    from megatron_maspo.loss.policy import compute_policy_loss
    from megatron_maspo.loss.reduce import aggregate, local_units, megatron_loss_tuple
    from megatron_maspo.loss.registry import METHOD_REGISTRY, token_losses

_HOME = {"compute_advantages": "advantages", "LossConfig": "config", "LossInputs": "inputs",
         "compute_policy_loss": "policy", "aggregate": "reduce", "local_units": "reduce",
         "megatron_loss_tuple": "reduce",
         "METHOD_REGISTRY": "registry", "token_losses": "registry"}
__all__ = ["LossConfig", "LossInputs", "METHOD_REGISTRY", "aggregate", "compute_advantages",
           "compute_policy_loss", "local_units", "megatron_loss_tuple", "token_losses"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
