"""The MoE token all-to-all under expert parallelism in the planner: what it moves, and what it costs.

Source: megatron-core 0.16.1, ``transformer/moe/token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher`` (the
``alltoall`` dispatcher, this project's default, ``model/moe.py``). Per MoE layer and micro-batch each
rank permutes its routed token copies, sends them to the experts' EP ranks (``token_dispatch``: one
``all_to_all`` of the hidden states and one of the routing probabilities over the EP group), runs its
local experts, and sends the outputs back (``token_combine``: one ``all_to_all``). Its input is the MoE
layer's input, which under sequence parallelism is the TP-split sequence ``[S/tp, B, h]``; with
expert-TP 1 (``parallel/groups.py``, ``model/moe.py``) the dispatcher's own TP size is 1, so there is
no all-gather over TP after the all-to-all (``dispatch_postprocess``) and each rank sends only its own
``S/tp`` tokens. Megatron refuses MoE training at TP > 1 without sequence parallelism
(``transformer/moe/moe_layer.py``, ``MoELayer.forward``), so the TP split always applies.

With uniform routing each token's ``k`` (``moe_router_topk``) copies land on the ``ep`` ranks evenly, so
``(ep - 1) / ep`` of them leave the GPU:

    tokens per GPU    t   = T / (cp tp)                   T: tokens of one data-parallel replica's pass
    bytes             b   = t k h e (ep - 1) / ep          one dispatch (or combine) over the pass; e: element
                                                          bytes of the hidden states (2, bf16)
    transfer          x   = max(b (1 - f) / bw_nvlink, b f / bw_ib)
    forward           L_moe (2 x + 3 M lat)                dispatch + combine; 3 collectives (tokens, probs,
                                                          combine) per micro-batch, M micro-batches
    backward          the same again (the autograd of an all-to-all is the reverse all-to-all,
                      ``tensor_parallel/mappings.py::_AllToAll``)

``L_moe`` counts the MoE layers of the busiest pipeline stage (each stage sees all T tokens) and ``lat``
is ``Assumptions.p2p_latency_us``.

``f`` is the fraction of a rank's EP peers on other nodes. Megatron's expert rank grid is
``tp-cp-ep-dp-pp`` with expert-TP 1 and no CP in it (``check/world.py::coordinates``), so an EP group is
``ep`` consecutive global ranks: inside one node when ``ep`` divides ``gpus_per_node``. NCCL posts every
peer's send at once, NVLink and the NIC run side by side, hence the ``max``. The probabilities' bytes
(one fp32 per copy, 4 / (h e) of the hidden states') are left out; their collective's latency is not.
The dense first layers (``moe_first_k_dense``, DeepSeek-V3's 3) have no all-to-all.

No overlap with compute: in megatron-core 0.16.1 the alltoall dispatcher overlaps its all-to-all only
with ``moe_shared_expert_overlap`` (shared experts, ``transformer_config.py``) or
``overlap_moe_expert_parallel_comm`` (``model_parallel_config.py``); both default to False and this
project sets neither, so the all-to-all sits on the critical path. Load imbalance (a hot expert's rank
receives more) is not modelled here; it stays in ``Assumptions.moe_expert_mfu``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_maspo.launch.plan.types import Assumptions, Layout
    from megatron_maspo.model.spec import ArchSpec

COLLECTIVES_PER_PASS = 3
"""All-to-alls per MoE layer and micro-batch in one direction: tokens and probabilities in
``token_dispatch``, outputs in ``token_combine`` (token_dispatcher.py, megatron-core 0.16.1)."""


def moe_layers_on_busiest_stage(spec: ArchSpec, pp: int, vpp: int | None = None, first: int | None = None,
                                last: int | None = None) -> int:
    """MoE layers of the pipeline stage holding most of them (the trainer's split, even or uneven:
    ``model.py::stage_layers``).

    The pipeline runs at its slowest stage's pace, and with dense first layers the first stage holds fewer
    MoE layers than the others.
    """
    from megatron_maspo.launch.plan.model import stage_layers

    return max((sum(spec.is_moe_layer(i) for i in layers)
                for layers in stage_layers(spec.num_layers, pp, vpp, first, last)), default=0)


def offnode_peer_fraction(ep: int, gpus_per_node: int) -> float:
    """f: the largest fraction of a rank's ``ep - 1`` EP peers on other nodes, over the EP groups.

    EP groups are ``ep`` consecutive ranks starting at multiples of ``ep``; the pattern repeats every
    lcm(ep, gpus_per_node) ranks, so those ranks cover every case.
    """
    if ep <= 1:
        return 0.0
    worst = 0
    for r in range(math.lcm(ep, gpus_per_node)):
        start = r // ep * ep
        worst = max(worst, sum(1 for q in range(start, start + ep) if q // gpus_per_node != r // gpus_per_node))
    return worst / (ep - 1)


def a2a_bytes(tokens_per_gpu: float, topk: int, hidden: int, elt: int, ep: int) -> float:
    """b = t k h e (ep - 1) / ep: bytes one GPU sends in one dispatch (or combine) all-to-all."""
    return tokens_per_gpu * topk * hidden * elt * (ep - 1) / ep


def a2a_transfer_seconds(nbytes: float, offnode: float, *, nvlink_gb_s: float, internode_gb_s: float) -> float:
    """max(b (1 - f) / bw_nvlink, b f / bw_ib): both links carry their share at once."""
    return max(nbytes * (1 - offnode) / (nvlink_gb_s * 1e9), nbytes * offnode / (internode_gb_s * 1e9))


def a2a_seconds(spec: ArchSpec, lay: Layout, tokens: float, elt: int, hw: Assumptions, gpus_per_node: int,
                *, micro_batches: int = 1) -> tuple[float, float]:
    """(forward, backward) exposed all-to-all seconds of one pass over ``tokens`` tokens per data-parallel
    replica, in ``micro_batches`` micro-batches; (0, 0) for dense models and at EP 1.

    forward = backward = L_moe (2 max(b (1 - f) / bw_nvlink, b f / bw_ib) + 3 M lat), b for
    t = T / (cp tp) tokens per GPU (module docstring).
    """
    layers = moe_layers_on_busiest_stage(spec, lay.pp, lay.vpp, lay.pp_first, lay.pp_last)
    if lay.ep <= 1 or layers == 0 or tokens <= 0:
        return 0.0, 0.0
    b = a2a_bytes(tokens / (lay.cp * lay.tp), spec.moe_router_topk, spec.hidden_size, elt, lay.ep)
    move = a2a_transfer_seconds(b, offnode_peer_fraction(lay.ep, gpus_per_node),
                                nvlink_gb_s=hw.nvlink_gb_s, internode_gb_s=hw.internode_gb_s)
    # bytes scale with the tokens, latencies with the collectives: one set per layer and micro-batch
    one_way = layers * (2 * move + COLLECTIVES_PER_PASS * micro_batches * hw.p2p_latency_us * 1e-6)
    return one_way, one_way
