"""Policy-loss family: MASPO, the GRPO family and a QUATRO reconstruction (pure PyTorch).

Entries: `token_losses` (per-token loss by method name), `compute_policy_loss` (the trainer's entry
with regularisers, aggregation and metrics), `compute_advantages` (group estimators). See
docs/losses.md for the method table and metric keys. No megatron import in this package.
"""

from megatron_maspo.loss.advantages import compute_advantages
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.policy import compute_policy_loss
from megatron_maspo.loss.reduce import aggregate, local_units, megatron_loss_tuple
from megatron_maspo.loss.registry import METHOD_REGISTRY, token_losses

__all__ = ["LossConfig", "METHOD_REGISTRY", "aggregate", "compute_advantages", "compute_policy_loss",
           "local_units", "megatron_loss_tuple", "token_losses"]
