"""Routing replay: the trainer's MoE routers pick the experts the rollout engine picked.

MoE RL suffers from a train/inference mismatch that dense models do not have: a tiny numerical
difference (bf16 engine vs fp32 router, other kernels) flips a near-tie in a router's top-k, the token
goes through different experts, and the importance ratio then mixes the policy change with routing
noise. Replay removes that part: the engine reports each token's top-k expert ids
(``Completion.routed_experts``, ``rollout/routing.py``), the samples carry them, and here they are
fed to Megatron-Core's ``RouterReplay`` (``moe_enable_routing_replay``) one micro-batch at a time.
The routers still compute their own scores, so the gate probabilities (and their gradient) are the
trainer's, only the expert *choice* is the engine's.

Layout of one micro-batch's targets: ``[num_moe_layers, S, k]`` int64 (dense first layers have none) for the packed row of ``S`` tokens
(sequences in ``mb.sample_index`` order, then the padding segment). Positions the engine has no entry
for (the last response token, which predicts nothing; padding) get experts ``0..k-1``: their outputs
reach no trained log-prob (attention is causal within each packed sequence).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_maspo.train.actor.moe_metrics import routers


def replay_targets(samples: Sequence[Any], mb: Any, *, num_layers: int, topk: int
                   ) -> torch.Tensor | None:
    """``[num_layers, S, k]`` int64 expert ids of micro-batch ``mb``, or None if a sample lacks them.

    Raises:
        ValueError: a sample's ``routed_experts`` is not ``[N, num_layers, k]``.
    """
    S = int(mb.tokens.numel())
    out = torch.arange(topk, dtype=torch.long).expand(num_layers, S, topk).clone()
    start = 0
    for i, n in zip(mb.sample_index, mb.seq_lens):
        r = samples[i].routed_experts
        if r is None:
            return None
        if r.dim() != 3 or r.shape[1] != num_layers or r.shape[2] != topk:
            raise ValueError(f"sample {i}: routed_experts has shape {tuple(r.shape)}, expected "
                             f"[tokens, {num_layers} layers, top-{topk}]")
        m = min(n, r.shape[0])
        out[:, start:start + m] = r[:m].long().permute(1, 0, 2)
        start += n
    return out


class RoutingReplay:
    """Feeds per-micro-batch targets to the ``RouterReplay`` of every router in ``chunks``.

    Args:
        chunks: the policy's model chunks (built with ``moe_enable_routing_replay``).
        moe_layers: global (0-based) ids of the layers with routed experts, in order; the engine records
            one entry per such layer (dense first layers have no gate), so the targets' first dimension
            is ``len(moe_layers)`` and layer ``moe_layers[j]`` replays entry ``j``.
    """

    def __init__(self, chunks: list, *, moe_layers: Sequence[int]) -> None:
        self.per_chunk = [[r for r in routers([c]) if r.router_replay is not None] for c in chunks]
        if not any(self.per_chunk):
            raise ValueError("routing replay needs routers built with moe_enable_routing_replay")
        self.num_layers = len(moe_layers)
        self.entry = {layer: j for j, layer in enumerate(moe_layers)}
        self.topk = next(r for rs in self.per_chunk for r in rs).topk
        self.missing = 0  # micro-batches run without replay (a sample had no routed experts)

    def targets(self, samples: Sequence[Any], mb: Any) -> torch.Tensor | None:
        t = replay_targets(samples, mb, num_layers=self.num_layers, topk=self.topk)
        if t is None:
            self.missing += 1
        return t

    def _set(self, chunk: int, target: torch.Tensor | None, device: torch.device) -> None:
        for r in self.per_chunk[chunk]:
            rr = r.router_replay
            rr.clear_indices()
            if target is None:
                rr.clear_router_replay_action()
            else:
                rr.set_target_indices(target[self.entry[r.layer_number - 1]].to(device))
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def iterate(self, chunk: int, inputs: list, targets: list, device: torch.device) -> Iterator:
        """Yield ``inputs`` in order, arming the routers of ``chunk`` with each one's targets first
        (Megatron's schedule takes a micro-batch from the iterator right before its forward)."""
        try:
            for x, t in zip(inputs, targets):
                self._set(chunk, t, device)
                yield x
        finally:
            self._set(chunk, None, device)

    def clear(self) -> None:
        """Routers back to their own top-k (after a schedule; also on errors)."""
        for c in range(len(self.per_chunk)):
            self._set(c, None, torch.device("cpu"))
