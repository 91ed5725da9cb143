"""Context parallelism in the planner: what CP splits, and what its ring K/V exchange costs (pure maths).

With ``cp`` context-parallel ranks, each packed row of ``N`` tokens (train.max_tokens_per_micro_batch)
is split into ``2 cp`` chunks, two per rank (load-balanced for causal attention, Megatron/TE's scheme),
so every rank holds ``N / cp`` tokens of it:

    activations, log-prob workspace    per GPU: as for a row of N / cp tokens
    linear FLOPs and attention FLOPs   split evenly over the cp ranks (the total over the world is unchanged)
    data-parallel size                 dp = world / (tp pp cp); gradients and the distributed optimizer
                                       shard over dp x cp (Megatron's data-parallel-with-CP group)

Ring attention: in every layer each rank passes its K/V chunk around the ring, ``cp - 1`` hops forward;
the backward sends K/V again and returns dK/dV (2x the bytes). A hop overlaps with the attention of the
chunk already received, so only what the attention does not hide is exposed:

    bytes per hop     b   = (N / cp) * 2 * ceil(n_g / tp) * d * e          K and V of the local chunk
    attention per hop a_f = 2 n_h d N s / (tp cp cp) / (peak mfu)          s = mean sequence length of the
                                                                             row (packed rows of length-s
                                                                             sequences: sum s_i^2 = N s)
    exposed forward   (cp - 1) * max(0, lat + b / bw - a_f)
    exposed backward  (cp - 1) * max(0, lat + 2 b / bw - 2 a_f)
    per step          micro-batches per data-parallel replica x layers per stage x the above

The attention term is quadratic in the sequence length: short packed sequences (RL responses of a few
hundred tokens) leave the exchange exposed, a row of one 16k sequence hides it completely. ``bw`` is the
NVLink figure when the tp x cp ranks of a row sit in one node, else the inter-node (InfiniBand) figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RingLoad:
    """What one context-parallel ring moves and computes per layer and micro-batch."""

    cp: int
    row_tokens: int
    """N: tokens of one packed micro-batch row (all cp ranks together)."""
    seq_mean: float
    """s: mean sequence length (prompt + response) packed into the row."""
    heads: int
    kv_groups: int
    head_dim: int
    tp: int
    elt: int
    """Element bytes of K/V (2 for bf16)."""


def kv_hop_bytes(r: RingLoad) -> float:
    """Bytes one rank sends per ring hop in the forward (its K and V chunk)."""
    return r.row_tokens / r.cp * 2 * math.ceil(r.kv_groups / r.tp) * r.head_dim * r.elt


def attention_hop_seconds(r: RingLoad, flops_per_s: float) -> float:
    """Forward attention compute one rank does per hop (hides the hop's transfer)."""
    return 2 * r.heads * r.head_dim * r.row_tokens * r.seq_mean / (r.tp * r.cp * r.cp) / flops_per_s


def ring_exposed_seconds(r: RingLoad, *, link_gb_s: float, latency_s: float,
                         flops_per_s: float) -> tuple[float, float]:
    """(forward, backward) exposed ring seconds per layer and micro-batch; (0, 0) without CP."""
    if r.cp <= 1:
        return 0.0, 0.0
    t_hop = kv_hop_bytes(r) / (link_gb_s * 1e9)
    a = attention_hop_seconds(r, flops_per_s)
    fwd = (r.cp - 1) * max(0.0, latency_s + t_hop - a)
    bwd = (r.cp - 1) * max(0.0, latency_s + 2 * t_hop - 2 * a)
    return fwd, bwd


def ring_link_gb_s(tp: int, cp: int, gpus_per_node: int, *, intra_gb_s: float, inter_gb_s: float) -> float:
    """The ring's bandwidth: NVLink when a row's tp x cp ranks fit in one node, else the inter-node link."""
    return intra_gb_s if tp * cp <= gpus_per_node else inter_gb_s


def cp_trainer_reasons(cfg, tp: int, pp: int, cp: int, world: int) -> list[str]:
    """The trainer's refusals of a CP layout (``parallel/layout_check.py::check_layout_supported``), as plan
    reasons."""
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.parallel.config import ParallelConfig
    from megatron_maspo.parallel.layout_check import check_layout_supported

    try:
        check_layout_supported(ParallelConfig(tp=tp, pp=pp, cp=cp, world_size=world), cfg.model, cfg.loss)
    except ConfigError as e:
        return [str(e)]
    return []
