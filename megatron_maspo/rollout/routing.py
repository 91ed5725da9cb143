"""Record which experts a transformers MoE model routes each token to, during generation (routing replay).

The built-in engine runs a left-padded prefill and then one token per step. :class:`RoutingRecorder`
hooks every MoE gate (a module with ``top_k`` under ``*.mlp.gate``), keeps each forward's top-k
indices ``[B·T, k]`` per layer, and :meth:`RoutingRecorder.per_row` lays them out per sequence:

    routed[r] : [P_r + n_r - 1, num_layers, k] int16
        prompt positions (left padding dropped), then the generated tokens that were fed back.

The last generated token is never fed to the model, and its hidden state predicts nothing the loss
uses, so it has no entry; the trainer fills such positions with its own routing (``train/actor/routing_replay.py``).
"""

from __future__ import annotations

from typing import Any

import torch


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE router modules of an HF causal LM, in layer order (empty for a dense model)."""
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]


def _indices(module: torch.nn.Module, output: Any) -> torch.Tensor:
    """``[tokens, k]`` expert ids from a gate's output: transformers >= 5 returns (logits, scores,
    indices); an older gate is a plain linear layer returning logits (top-k of the softmax, as HF does)."""
    if isinstance(output, tuple) and len(output) >= 3:
        return output[2]
    logits = output[0] if isinstance(output, tuple) else output
    return torch.topk(torch.softmax(logits.float(), dim=-1), module.top_k, dim=-1).indices


class RoutingRecorder:
    """Context manager: records every gate's top-k indices of each model call made inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.gates = moe_gates(model)
        self.steps: list[list[torch.Tensor]] = []  # [call][layer] -> [B, T, k]
        self._pending: list[torch.Tensor] = []
        self._handles: list = []
        self._shape: tuple[int, int] = (0, 0)

    def __enter__(self) -> RoutingRecorder:
        for g in self.gates:
            self._handles.append(g.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget the calls recorded so far (hooks stay attached)."""
        self.steps, self._pending = [], []

    def begin_call(self, batch: int, length: int) -> None:
        """Announce the next model call's ``[B, T]`` input shape (gates see flattened tokens)."""
        self._shape = (batch, length)

    def end_call(self) -> None:
        if len(self._pending) != len(self.gates):
            raise RuntimeError(f"routing recorder: {len(self._pending)} gate calls for "
                               f"{len(self.gates)} MoE layers in one forward")
        b, t = self._shape
        self.steps.append([x.view(b, t, -1) for x in self._pending])
        self._pending = []

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._pending.append(_indices(module, output).detach().to("cpu", torch.int16))

    def per_row(self, prompt_lens: list[int], gen_lens: list[int]) -> list[torch.Tensor]:
        """``[P_r + n_r - 1, L, k]`` int16 per row ``r`` (prompt ``P_r`` tokens, ``n_r`` generated).

        Call ``0`` is the prefill (left-padded to the longest prompt); call ``t >= 1`` fed the token
        sampled at step ``t - 1``.
        """
        if not self.steps:
            return [torch.zeros(0, len(self.gates), 0, dtype=torch.int16) for _ in prompt_lens]
        prefill = torch.stack(self.steps[0], dim=2)  # [B, Lp, L, k]
        decode = (torch.cat([torch.stack(s, dim=2) for s in self.steps[1:]], dim=1)
                  if len(self.steps) > 1 else prefill[:, :0])  # [B, steps-1, L, k]
        out = []
        for r, (p, n) in enumerate(zip(prompt_lens, gen_lens)):
            fed = max(n - 1, 0)
            out.append(torch.cat([prefill[r, prefill.shape[1] - p:], decode[r, :fed]], dim=0).contiguous())
        return out
