"""The forward-step function for Megatron's pipeline schedule: hidden → response log-probs → loss.

On the last pipeline stage the model's output layer is swapped for a pass-through
(:func:`hidden_output`), so ``GPTModel`` returns the final-norm hidden states ``[1, S, H]`` instead
of ``[1, S, V/tp]`` logits. We gather the response positions (``[T, H]``, T ≪ S) and call the fused
``vocab_parallel_logprobs_from_hidden`` with the output weight (the shared embedding when tied) and
the TP group: prompt positions are never projected onto the vocabulary and no full logits tensor
exists.

The loss function returns Megatron's 3-tuple ``(numerator·N_glob, n_local, {})`` under
``calculate_per_token_loss=True``: ``compute_policy_loss`` already divides by the global count, we
multiply back by ``N_glob`` and report this micro-batch's token count, so ``finalize_model_grads``'
division by ``Σ_{micro-batches, DP} n_local = N_glob`` yields exactly the global aggregate of any
aggregation mode (loss-formulas.md §2.2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_maspo.loss.metrics import accumulate_metrics
from megatron_maspo.loss.reduce import megatron_loss_tuple
from megatron_maspo.model.checkpoint import unwrap
from megatron_maspo.parallel.logprobs import vocab_parallel_logprobs_from_hidden
from megatron_maspo.parallel.sequence_parallel import gather_rows_sequence_parallel

logger = logging.getLogger(__name__)


class _PassThrough(torch.nn.Module):
    """Stands in for ``ColumnParallelLinear`` output layer: returns ``(hidden, None)``."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate params

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped layer's ``[V/tp, H]`` weight: with tied embeddings and PP > 1 the last
        stage's ``shared_embedding_or_output_weight()`` reads ``output_layer.weight``."""
        return self.original.weight

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return hidden, None


def output_weight(model: Any) -> torch.Tensor:
    """``[V/tp, H]`` output projection of a last-stage chunk: the shared embedding when tied."""
    m = unwrap(model)
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


@contextlib.contextmanager
def hidden_output(chunks: list):
    """Within the block, last-stage chunks return hidden states instead of logits."""
    saved = []
    for c in chunks:
        m = unwrap(c)
        if m.post_process:
            saved.append((m, m.output_layer))
            m.output_layer = _PassThrough(m.output_layer)
    try:
        yield
    finally:
        for m, layer in saved:
            m.output_layer = layer


@dataclass
class MicroBatchInputs:
    """Tensors of one packed micro-batch, on the compute device.

    ``tokens``/``position_ids``: [1, S] int64; ``attention_mask``: [1, 1, S, S] bool (True = masked)
    or None; ``packed_seq_params``: thd ``PackedSeqParams`` (cu_seqlens) on the packed attention
    paths, None with the dense mask; the rest are [T] per response token: ``resp_index``/``labels``/``seq_ids``/
    ``prompt_ids`` int64, ``loss_mask``/``advantages`` fp32, ``old_logprobs``/``ref_logprobs``/
    ``rollout_logprobs`` fp32 or None.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    resp_index: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    prompt_ids: torch.Tensor
    advantages: torch.Tensor
    num_tokens: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    packed_seq_params: Any = None
    group_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """[T] per-token values of ``Sample.group_stats`` (e.g. ``quatro/lambda``)."""
    cp_share: Any = None
    """At cp > 1: this CP rank's :class:`~megatron_maspo.train.actor.cp_split.CPShare` of the row
    (the tensors above are then the local rows and the response tokens this rank predicts)."""


@dataclass
class StepContext:
    """What the forward step needs besides the micro-batch; accumulates outputs on the last stage.

    Attributes:
        tp_group: tensor-parallel group the vocabulary is split over.
        vocab_size: true (unpadded) vocabulary size.
        temperature: rollout temperature τ (log-probs of ``softmax(z / τ)``).
        chunk_bytes: workspace budget of the fused log-prob kernel (None = device default).
        logprob_kernel: ``train.logprob_kernel`` (``auto``, ``torch``, ``triton``).
        loss_fn: ``(mb, logprobs, entropy) -> (numerator / N_glob, metrics)``; None = forward only.
        num_tokens_global: N_glob of the mini-batch (loss mode).
        logprobs: collected detached ``[T]`` log-probs, one per micro-batch, in order.
        entropies: collected detached ``[T]`` entropies.
        sequence_parallel: the last stage's hidden states are split along the sequence over
            ``tp_group`` (TE spec at TP > 1): gather only the response rows.
        metrics: summed metrics (pre-divided by the global count).
        loss_finite: False once any micro-batch gave a non-finite loss.
        batch_stats: the mini-batch statistics every loss call received (BAPO's bounds).
    """

    tp_group: Any
    vocab_size: int
    temperature: float
    chunk_bytes: int | None
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None
    num_tokens_global: int = 0
    logprobs: list[torch.Tensor] = field(default_factory=list)
    entropies: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_finite: bool = True
    sequence_parallel: bool = False
    logprob_kernel: str = "auto"
    batch_stats: dict[str, torch.Tensor] = field(default_factory=dict)


def make_forward_step(ctx: StepContext) -> Callable:
    """Build ``forward_step(data_iterator, model) -> (output, loss_func)`` for the schedule."""

    def loss_func(mb: MicroBatchInputs, output: torch.Tensor):
        lp, ent = output[0], output[1]
        ctx.logprobs.append(lp.detach().clone())
        ctx.entropies.append(ent.detach().clone())
        if ctx.loss_fn is None:  # forward only: nothing to reduce
            return lp.sum() * 0.0, torch.tensor(mb.num_tokens, dtype=torch.int), {}
        loss, metrics = ctx.loss_fn(mb, lp, ent)
        if not bool(torch.isfinite(loss.detach())):
            ctx.loss_finite = False
        new = {k: v.detach().float() for k, v in {**metrics, "actor/loss": loss}.items()}
        ctx.metrics = accumulate_metrics(ctx.metrics, new)  # SUM, or MIN/MAX for *_min/*_max keys
        # ×N_glob here, ÷Σn_local = ÷N_glob in finalize_model_grads: the exact global aggregate
        return megatron_loss_tuple(loss, num_local_units=mb.num_tokens,
                                   num_global_units=max(ctx.num_tokens_global, 1))

    def forward_step(data_iterator: Iterator[MicroBatchInputs], model: Any):
        mb = next(data_iterator)
        out = model(mb.tokens, mb.position_ids, mb.attention_mask,
                    packed_seq_params=mb.packed_seq_params)
        if not unwrap(model).post_process:
            return out, (lambda o: (o.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}))
        if ctx.sequence_parallel:  # out[0]: [S/tp, H], this rank's slice of the sequence
            hidden = gather_rows_sequence_parallel(out[0], mb.resp_index, ctx.tp_group)
        else:
            hidden = out[0].index_select(0, mb.resp_index)  # [T, H], replicated over TP
        lp, ent = vocab_parallel_logprobs_from_hidden(
            hidden, output_weight(model), mb.labels, ctx.tp_group, temperature=ctx.temperature,
            chunk_bytes=ctx.chunk_bytes, vocab_size=ctx.vocab_size, kernel=ctx.logprob_kernel)
        return torch.stack([lp, ent]), (lambda o: loss_func(mb, o))

    return forward_step
