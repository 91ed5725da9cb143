"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's ``MLASelfAttention``, local spec.

What megatron-core 0.16.1 computes per layer (``transformer/multi_latent_attention.py``), for hidden
``x`` ``[s, b, H]``, ``n`` heads, nope dims ``d_n`` (``qk_head_dim``), rotary dims ``d_r``
(``qk_pos_emb_head_dim``), value dims ``d_v`` (``kv_channels``)::

    q        = W_qb · RMSNorm(W_qa · x)                [s, b, n, d_n + d_r]   (W_q · x without q_lora_rank)
    c, k_r   = split(W_kva · x, [kv_lora_rank, d_r])   c: the compressed latent, k_r: one rotary key
    k_n, v   = split(W_kvb · RMSNorm(c), [d_n, d_v])   per head
    q_r, k_r = RoPE(q_r), RoPE(k_r)                    de-interleaved first: (x0, x2, ..; x1, x3, ..)
    K        = [k_n ; k_r expanded to n heads]          key head d_n + d_r, value head d_v
    out      = W_o · softmax(q·K / sqrt(d_n + d_r) · m²) · v

with YaRN (``rope_scaling="yarn"``) scaling cos/sin by the concentration factor and ``m =
0.1·mscale_all_dim·ln(factor) + 1``; HF ``DeepseekV3Attention`` computes the same (``rope_interleave=True``:
its pairs are the ones megatron de-interleaves; False is handled by permuting weight rows in conversion,
``conversion/shard.py``). The MLA RoPE flag is ``config.multi_latent_attention`` on 0.16.1
(``mla_rotary_interleaved`` on 0.19, ``mcore_compat``).

**TP backward fix.** On the local spec the down projections are column-parallel and their outputs are
all-gathered (``gather_from_tensor_model_parallel_region``: backward = take this rank's slice). That
backward is exact for ``c`` and the q latent: their consumers (the column-parallel up projections)
all-reduce their input gradient over TP. It is not for the rotary key ``k_r``: every TP rank uses it for
its own heads only, so each rank's gradient of ``k_r`` is a partial sum, and megatron-core 0.16.1 drops
the other ranks' parts (TP 2 gradients of ``kv_a_proj_with_mqa`` and everything below it off by ~0.3
relative on the tiny model; forward values exact). :class:`MLASelfAttentionTP` routes that one gather
through :class:`_GatherKVLatent`, whose backward all-reduces the rotary columns over TP first.

On the local spec the core attention receives keys of ``d_n + d_r`` and values of ``d_v`` dims
(``k_channels`` / ``v_channels``): :class:`~.packed_attention.PackedSDPAttention` takes them, and
:class:`ChannelsDotProductAttention` gives Megatron's ``DotProductAttention`` (the ``dense_mask``
reference) the value width it reshapes its output to.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide

from megatron_maspo.model import mcore_compat
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel import comm


def mla_transformer_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """``MLATransformerConfig`` fields for ``spec`` (every YaRN field explicit: its defaults are
    DeepSeek-V3's, wrong for any other model, conversion-rules.md §8)."""
    yarn = spec.rope_scaling == "yarn"
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_head_dim,
        qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.kv_channels,
        rope_type="yarn" if yarn else "rope",
        rotary_base=spec.rotary_base,
        rotary_percent=1.0,
        # without YaRN: factor 1 makes the softmax's m = 1 whatever mscale_all_dim is
        rotary_scaling_factor=spec.rope_scaling_factor if yarn else 1.0,
        original_max_position_embeddings=(spec.yarn_original_max_position_embeddings if yarn
                                          else spec.max_position_embeddings),
        beta_fast=spec.yarn_beta_fast,
        beta_slow=spec.yarn_beta_slow,
        mscale=spec.yarn_mscale if yarn else 1.0,
        mscale_all_dim=spec.yarn_mscale_all_dim if yarn else 0.0,
    )


def mla_layer_spec(spec: ArchSpec, *, grouped_gemm: bool, core_attention: type | None):
    """Megatron's local MLA layer spec (q/kv latent RMSNorms on), with ``core_attention`` swapped in
    (None: :class:`ChannelsDotProductAttention`, the ``dense_mask`` reference)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mcore_compat.mla_without_te()
    if spec.q_lora_rank is None and not mcore_compat.local_mla_without_q_latent():
        raise ValueError("multi-latent attention without a query latent (q_lora_rank=None, DeepSeek-V2-Lite "
                         "style) does not build on the local spec with this megatron-core (0.19 takes the "
                         "query projection from Transformer Engine): use megatron-core 0.16.1 or the TE spec")
    lspec = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=grouped_gemm,
                                     qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")
    attention: Any = lspec.submodules.self_attention  # type: ignore[attr-defined]
    attention.module = MLASelfAttentionTP
    _install_gather()
    if spec.q_lora_rank is None:
        # no q latent: MLASelfAttention builds no q norm, the spec's module would be unused; and the full
        # q projection is named here: megatron-core 0.19's local MLA spec fills it from the TE backend (a
        # stand-in without TE)
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear
        from megatron.core.transformer.identity_op import IdentityOp

        attention.submodules.q_layernorm = IdentityOp
        attention.submodules.linear_q_proj = ColumnParallelLinear
    attention.submodules.core_attention = core_attention or ChannelsDotProductAttention
    return lspec


class ChannelsDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` taking key/value head widths (``k_channels``/``v_channels``).

    Scores come from the query/key tensors as given (``[s, b, n, k_channels]``); only the output reshape
    needs the value width: ``[s, b, n/tp · v_channels]``. The softmax scale is the caller's (MLA passes
    its YaRN-corrected one). Versions whose ``DotProductAttention`` takes the two widths receive them
    (``mcore_compat.core_attention_channel_kwargs``).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **mcore_compat.core_attention_channel_kwargs(DotProductAttention, k_channels,
                                                                      v_channels))
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * divide(config.num_attention_heads,
                                                                 self.tp_group.size())


_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("maspo_mla_gather", default=None)
_ORIGINAL_GATHER = multi_latent_attention.gather_from_tensor_model_parallel_region


class _GatherKVLatent(torch.autograd.Function):
    """All-gather of the KV down projection's output ``[.., (kv_lora_rank + d_r)/tp]`` -> ``[.., kv_lora_rank + d_r]``;
    backward: all-reduce the last ``d_r`` (rotary key) columns over TP, then this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rope: int) -> torch.Tensor:  # noqa: ANN001 - a process group
        ctx.group, ctx.rope = group, rope
        return mappings._gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        grad = grad.clone()
        tail = grad[..., -ctx.rope:].contiguous()
        comm.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.rope:] = tail
        return mappings._split_along_last_dim(grad, ctx.group), None, None


def _mla_gather(input_: torch.Tensor, group=None) -> torch.Tensor:  # noqa: ANN001
    """megatron-core's gather inside ``MLASelfAttention``; inside :class:`MLASelfAttentionTP` the KV one is
    :class:`_GatherKVLatent`. The calls come in code order: the q latent's (with ``q_lora_rank``), then KV's."""
    state = _ACTIVE.get()
    if state is None:
        return _ORIGINAL_GATHER(input_, group)
    group = mappings.get_tensor_model_parallel_group_if_none(group)
    index, state["calls"] = state["calls"], state["calls"] + 1
    if index != state["kv_index"]:
        return _ORIGINAL_GATHER(input_, group)
    if input_.size(-1) * group.size() != state["kv_width"]:
        raise RuntimeError(f"MLA KV gather: got {input_.size(-1)} x {group.size()} columns, expected "
                           f"{state['kv_width']} (megatron-core's MLA call order changed?)")
    return _GatherKVLatent.apply(input_, group, state["rope"])


def _install_gather() -> None:
    """Route ``multi_latent_attention``'s gather through :func:`_mla_gather` (idempotent; any other caller
    sees the original)."""
    multi_latent_attention.gather_from_tensor_model_parallel_region = _mla_gather


class MLASelfAttentionTP(multi_latent_attention.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with the rotary key's TP gradient completed (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The latent q/kv norms run on the gathered latent, so every TP rank already holds their whole
        # gradient. The config's qk_layernorm (which megatron-core 0.19 needs on for these norms) would make
        # finalize_model_grads *sum* them over TP; averaging identical gradients keeps them. Under sequence
        # parallelism the norms see this rank's tokens only and the sequence-parallel sum is the right one.
        if not self.config.sequence_parallel:
            for norm in (getattr(self, "q_layernorm", None), getattr(self, "kv_layernorm", None)):
                for p in norm.parameters() if isinstance(norm, torch.nn.Module) else ():
                    p.average_gradients_across_tp_domain = True

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):  # noqa: ANN201 - as the parent's
        cfg = self.config
        state = {"calls": 0, "kv_index": 0 if cfg.q_lora_rank is None else 1,
                 "kv_width": cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, "rope": cfg.qk_pos_emb_head_dim}
        token = _ACTIVE.set(state)
        try:
            return super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
