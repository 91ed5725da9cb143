"""The local spec's norms under Megatron sequence parallelism (SP), for TP x EP MoE on any machine.

Megatron refuses MoE with tensor parallelism unless sequence parallelism is on (``ModelParallelConfig``:
"When using expert parallelism and tensor parallelism, sequence parallelism must be used"), and the
local spec's norm builder (``transformer/torch_norm.py``, ``WrappedTorchNorm``) refuses SP: under SP
each TP rank normalises only its ``S/TP`` rows, so a norm weight's gradient is a partial sum that must
be added up over the TP group. Transformer Engine's norms mark their parameters for that
(``sequence_parallel`` attribute); ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``)
then sums the marked gradients over TP. :class:`SequenceParallelTorchNorm` is the same torch norm with
the same mark, so the local spec gets what the TE spec has. The forward is the plain per-row
``torch.nn.RMSNorm`` / ``LayerNorm``: row-local maths, identical with or without SP.
"""

from __future__ import annotations

from typing import Any

import torch


class SequenceParallelTorchNorm:
    """Build a ``torch.nn.RMSNorm`` / ``LayerNorm`` whose parameters carry
    ``sequence_parallel = config.sequence_parallel`` (a builder, like Megatron's ``WrappedTorchNorm``).

    Shapes: weight ``[hidden_size]``; input ``[..., hidden_size]`` (``[S/TP, B, H]`` under SP).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma and memory-efficient norms are not supported by the torch norm")
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r}; accepted: {sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
