"""An inference-only Megatron-Core policy for ``maspo eval``: weights and nothing else.

The training actor wraps its chunks in Megatron DDP (a contiguous fp32 gradient buffer the size of
the model) and builds the optimizer (fp32 master weights for bf16 plus Adam's two moments): 4 + 12
bytes per parameter that evaluation never touches. :class:`InferencePolicy` builds the same
``GPTModel`` chunks (same layout, same parallel groups, so checkpoints load and weight sync
exports exactly as from the actor), freezes them and stops there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from megatron_maspo.model.config import ModelConfig
from megatron_maspo.model.moe import moe_build_options
from megatron_maspo.model.provider import (
    ModelBuildOptions,
    attention_options,
    build_model_chunks,
    loaded_weights_options,
)
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.config import ParallelConfig, sequence_parallel_on
from megatron_maspo.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


def actor_build_options(model: ModelConfig, parallel: ParallelConfig,
                        spec: ArchSpec | None = None) -> ModelBuildOptions:
    """The model options the actor and the inference policy share (layout, precision, spec); ``spec``
    decides the default of ``parallel.sequence_parallel`` (on for MoE at TP > 1)."""
    p = parallel
    opts = ModelBuildOptions(
        tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, pp_first_layers=p.pp_first_layers,
        pp_last_layers=p.pp_last_layers, cp=p.cp, cp_comm_type=p.cp_comm_type, bf16=model.bf16,
        fp16=model.fp16, recompute=model.recompute,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        calculate_per_token_loss=True, **attention_options(model.attention_backend, p.tp),
        **moe_build_options(model))
    opts.sequence_parallel = sequence_parallel_on(p.sequence_parallel, model.attention_backend, p.tp,
                                                  bool(spec is not None and spec.is_moe))
    return opts


class InferencePolicy:
    """Frozen ``GPTModel`` chunks of this rank, in eval mode, without DDP or optimizer.

    Quacks like the actor where evaluation needs it: :meth:`named_modules_unwrapped` (weight sync,
    checkpoint loading with ``load_optimizer=False``) and ``steps_done``.

    Args:
        spec: the architecture.
        groups: this rank's parallel groups (``init_parallel`` already ran with ``parallel``'s sizes).
        model, parallel: the model (precision, attention) and layout sections of the config.
        init_weights: optional ``init_weights(chunks)`` (e.g. HF weights) before a checkpoint load.
    """

    def __init__(self, spec: ArchSpec, groups: ParallelGroups, *, model: ModelConfig,
                 parallel: ParallelConfig, init_weights: Callable[[list], None] | None = None) -> None:
        p = parallel
        if (groups.tp, groups.pp, groups.ep) != (p.tp, p.pp, p.ep):
            raise ValueError(f"parallel groups (tp={groups.tp}, pp={groups.pp}, ep={groups.ep}) do "
                             f"not match parallel (tp={p.tp}, pp={p.pp}, ep={p.ep})")
        self.spec, self.groups = spec, groups
        opts = actor_build_options(model, parallel, spec)
        self.chunks = build_model_chunks(spec, opts if init_weights is None else loaded_weights_options(opts),
                                         pp_rank=groups.pp_rank)
        if init_weights is not None:
            init_weights(self.chunks)
        for c in self.chunks:
            c.requires_grad_(False)
            c.eval()
        self.optimizer = None
        self.steps_done = 0

    def named_modules_unwrapped(self) -> list[torch.nn.Module]:
        """The ``GPTModel`` chunks (nothing wraps them)."""
        return list(self.chunks)

    def num_bytes(self) -> int:
        """Bytes of this rank's parameters and buffers: all the policy holds."""
        return sum(t.numel() * t.element_size() for c in self.chunks
                   for t in [*c.parameters(), *c.buffers()])
