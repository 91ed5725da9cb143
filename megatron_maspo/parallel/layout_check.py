"""The layouts the trainer refuses to build, checked from the config alone (no torch, no megatron-core).

``maspo train`` runs :func:`check_layout_supported` before anything heavy is imported (through
``train/preflight.py``), and the planner turns the same refusals into plan reasons
(``launch/plan/cp.py``), so a layout ``maspo plan`` accepts is one the trainer builds.
"""

from __future__ import annotations

from megatron_maspo.errors import ConfigError
from megatron_maspo.parallel.config import ParallelConfig


def check_layout_supported(parallel: ParallelConfig, model=None, loss=None) -> None:
    """Refuse, with a one-line ConfigError naming the field, layouts the trainer does not build.

    Context parallelism (``parallel.cp > 1``) splits each sequence's tokens over CP ranks, so it
    needs the packed (thd) attention paths and losses whose terms are per token: sequence-level
    aggregation and statistics (they read a whole sequence on one rank) and routing replay (its
    targets are per full row) are refused with it. ``model`` and ``loss`` are the config sections.
    """
    if parallel.cp == 1:
        return
    if model is not None and model.attention_backend == "dense_mask":
        raise ConfigError(f"parallel.cp={parallel.cp} needs model.attention_backend 'packed_sdpa' or 'te' "
                          "(the dense mask is one [S, S] tensor per row; it does not split)")
    if model is not None and model.routing_replay != "off":
        raise ConfigError(f"model.routing_replay={model.routing_replay!r} is not supported with "
                          f"parallel.cp={parallel.cp} (replay targets are per full row); use 'off'")
    if loss is not None and loss.effective_aggregation != "token-mean":
        raise ConfigError(f"loss.aggregation={loss.effective_aggregation!r} with parallel.cp={parallel.cp}: "
                          "a sequence's tokens are split over CP ranks; use 'token-mean'")
