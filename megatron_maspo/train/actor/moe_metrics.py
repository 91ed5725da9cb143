"""Per-step ``moe/*`` metrics of the training forwards: expert load, dropped tokens, router entropy, aux losses.

:class:`RouterMonitor` wraps every ``TopKRouter.routing`` of the policy chunks. During a training
forward (module in train mode, autograd on) it accumulates, per MoE layer of this pipeline stage:

* tokens routed to each expert (``routing_map.sum(0)``, ``[E]``), after capacity dropping;
* selections lost to the capacity factor (``topk·tokens - routing_map.sum()``);
* the entropy of the softmax over the router logits (summed over tokens, and the token count).

Megatron's own tracker (``moe_utils.get_moe_layer_wise_logging_tracker``) holds the aux and z losses
it attached to the activations (``MoEAuxLossAutoScaler``), divided by their coefficients; they are
read, averaged over forwards and layers, and cleared here too.

:meth:`RouterMonitor.collect` sums everything over the world (each MoE layer lives on exactly one
PP stage; TP ranks see the same tokens, so counts are divided by TP) and returns:

``moe/load_imbalance``  max/mean tokens per expert, averaged over layers (1 = perfectly balanced);
``moe/dropped_frac``    dropped selections / (topk · tokens);
``moe/router_entropy``  mean per-token entropy of the router distribution, nats (ln E = uniform);
``moe/aux_loss``, ``moe/z_loss``  mean unscaled values per layer and forward (only when configured).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megatron_maspo.parallel import comm

_LOSS_KEYS = {"load_balancing_loss": "moe/aux_loss", "seq_load_balancing_loss": "moe/aux_loss",
              "global_load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}


def routers(chunks: list) -> list:
    """Every ``TopKRouter`` of the (possibly DDP-wrapped) chunks, in module order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def router_entropy_sum(logits: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of the entropy (nats) of ``softmax(logits)``; ``logits`` ``[T, E]`` -> scalar fp64."""
    logp = torch.log_softmax(logits.detach().float(), dim=-1)
    return -(logp.exp() * logp).sum(-1).double().sum()


class RouterMonitor:
    """Accumulates routing statistics of training forwards; :meth:`collect` once per step."""

    def __init__(self, chunks: list, *, num_layers: int) -> None:
        self.routers = routers(chunks)
        self.num_layers = num_layers
        e = self.routers[0].config.num_moe_experts if self.routers else 0
        self.topk = self.routers[0].topk if self.routers else 0
        self.counts = torch.zeros(num_layers, e, dtype=torch.float64)  # [L, E] tokens per expert
        self.ent = torch.zeros(2, dtype=torch.float64)  # Σ entropy, tokens
        self.forwards = torch.zeros(num_layers, dtype=torch.float64)  # training forwards per layer
        self.tokens = torch.zeros(num_layers, dtype=torch.float64)  # tokens routed per layer
        for r in self.routers:
            self._wrap(r)

    def _wrap(self, router: Any) -> None:
        inner = router.routing
        mon = self

        def routing(self_, logits: torch.Tensor, *args: Any, **kwargs: Any):
            probs, routing_map = inner(logits, *args, **kwargs)
            if self_.training and torch.is_grad_enabled():
                mon.record(self_.layer_number, logits.reshape(-1, logits.shape[-1]), routing_map)
            return probs, routing_map

        router.routing = types.MethodType(routing, router)

    def record(self, layer_number: int, logits: torch.Tensor, routing_map: torch.Tensor) -> None:
        """Add one forward of layer ``layer_number`` (1-based, global): ``logits``/``routing_map`` ``[T, E]``.

        Accumulates on the logits' device (no host sync inside the forward); :meth:`collect` reads once.
        """
        if self.counts.device != logits.device:
            self.counts, self.ent = self.counts.to(logits.device), self.ent.to(logits.device)
        i = layer_number - 1
        self.counts[i] += routing_map.detach().sum(0).double()
        self.forwards[i] += 1
        self.tokens[i] += routing_map.shape[0]
        self.ent[0] += router_entropy_sum(logits)
        self.ent[1] += logits.shape[0]

    def collect(self, tp: int) -> dict[str, float]:
        """World-reduced metrics of everything recorded since the last call; resets the state.

        Every rank must call it (it all-reduces over the default group).
        """
        tracker = get_moe_layer_wise_logging_tracker()
        names = sorted(n for n in tracker if n in _LOSS_KEYS)
        losses = torch.zeros(2, self.num_layers, dtype=torch.float64)  # [aux, z] sums per layer
        for n in names:
            losses[int(_LOSS_KEYS[n] == "moe/z_loss")] += tracker[n]["values"].detach().double().cpu()
            tracker[n]["values"].zero_()
        L, E = self.counts.shape
        flat = torch.cat([self.counts.flatten().cpu(), self.ent.cpu(), self.forwards, self.tokens,
                          losses.flatten()])
        comm.all_reduce(flat)
        counts, rest = flat[:L * E].view(L, E) / tp, flat[L * E:]
        ent, fwd, tokens, loss = rest[:2] / tp, rest[2:2 + L], rest[2 + L:2 + 2 * L] / tp, rest[2 + 2 * L:]
        for t in (self.counts, self.ent, self.forwards, self.tokens):
            t.zero_()
        seen = fwd > 0
        if not bool(seen.any()):
            return {}
        c = counts[seen]
        mean = c.mean(-1).clamp_min(1e-12)
        wanted = float(tokens[seen].sum()) * self.topk
        out = {"moe/load_imbalance": float((c.max(-1).values / mean).mean()),
               "moe/dropped_frac": max(0.0, 1.0 - float(c.sum()) / max(wanted, 1e-12)),
               "moe/router_entropy": float(ent[0] / ent[1].clamp_min(1.0))}
        # losses: mean over (rank, forward, layer) of the unscaled value each rank recorded
        loss = loss.view(2, L)
        cfg = self.routers[0].config
        wanted_losses = {"moe/aux_loss": (cfg.moe_router_load_balancing_type != "none"
                                          and bool(cfg.moe_aux_loss_coeff)),
                         "moe/z_loss": bool(cfg.moe_z_loss_coeff)}
        for k, name in ((0, "moe/aux_loss"), (1, "moe/z_loss")):
            if wanted_losses[name]:  # the tracker is process-global: other models' names linger in it
                out[name] = float(loss[k][seen].sum() / fwd[seen].sum())
        return out
