"""The trainer's Gated DeltaNet (Qwen3.5's linear attention): a local-spec mixer that packs exactly.

:class:`GatedDeltaNet` takes the place of ``self_attention`` in a Megatron ``TransformerLayer`` (same
call: ``[s, b, h]`` in, ``(output, bias)`` out). Per token it projects ``q, k`` (``n_k`` heads of
``d_k``), ``v`` and the output gate ``z`` (``n_v`` heads of ``d_v``), and per value head the write
strength ``β = σ(b)`` and the log-decay ``g = −e^{A_log} · softplus(a + dt_bias)``; ``q, k, v`` pass
a depthwise causal conv (kernel ``K``) and SiLU; the gated delta rule (``gdn_ops``) mixes the tokens;
its output is RMS-normalised per head (weight ``w``, not zero-centred), multiplied by ``silu(z)`` and
projected back to ``h``.

Packing: on the thd path (``packed_seq_params``, b = 1) and on the unpacked path (each of the b rows
is one sequence) both the conv and the recurrent state restart at every sequence start, so a packed
row gives exactly what each sequence gives alone. Context parallelism is refused.

Tensor parallelism (rank ``r`` of ``tp``) splits heads: the rank keeps key heads
``[r·n_k/tp, (r+1)·n_k/tp)`` and the value heads that read them. Its slice of the fused input
projection (``ColumnParallelLinear``, ``[P/tp, h]``) is laid out
``[q_r | k_r | v_r | z_r | b_r | a_r]`` (``gdn_layout`` builds it from HF's separate projections),
its conv rows (``[C/tp, 1, K]``, HF's conv layout) ``[q_r | k_r | v_r]``, ``A_log``/``dt_bias`` its value heads; the output
projection is row-parallel. The norm weight is shared by all heads, so its gradient is summed over
TP in backward (identity forward).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_maspo.model.gdn_dims import GdnDims
from megatron_maspo.model.gdn_kernels import chunk_gated_delta_rule
from megatron_maspo.model.gdn_layout import conv_rows_for_rank
from megatron_maspo.model.gdn_ops import gated_rmsnorm, packed_causal_conv1d


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet mixer for the local spec (see the module docstring).

    Args:
        config: the layer's ``TransformerConfig`` (``hidden_size``, ``layernorm_epsilon``,
            ``init_method``, ``output_layer_init_method``, ``context_parallel_size``).
        layer_number: 1-based layer number (kept for Megatron's bookkeeping).
        dims: the mixer's sizes (``ModuleSpec.params``).
        pg_collection: Megatron's process groups (``tp`` read); None = Megatron's global ones.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, dims: GdnDims,
                 pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("linear attention (Gated DeltaNet) does not support context parallelism yet: "
                             f"set context_parallel_size=1 (got {config.context_parallel_size})")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        dims.check_tp(tp)
        self.dims, self.layer_number = dims, layer_number
        self.parts = dims.part_sizes(tp)
        self.n_k, self.n_v = dims.num_key_heads // tp, dims.num_value_heads // tp
        h = config.hidden_size
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            h, sum(dims.part_sizes()), config=config, init_method=config.init_method,  # type: ignore[arg-type]
            bias=False,
            gather_output=False, skip_bias_add=True, tp_group=self.tp_group)
        self.out_proj = tensor_parallel.RowParallelLinear(
            dims.num_value_heads * dims.value_head_dim, h, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,  # type: ignore[arg-type]
            skip_bias_add=True, tp_group=self.tp_group)
        # Full-size draws from the (TP-identical) default generator, then this rank's slice: the
        # same seed gives the same model at every TP size. ``device=None`` keeps the ambient device
        # (the meta device under ``maspo check``).
        k, dtype = dims.conv_kernel, config.params_dtype
        dev = None if config.use_cpu_initialization else torch.cuda.current_device()
        conv = torch.empty(dims.conv_channels(), k, device=dev).uniform_(-1 / math.sqrt(k), 1 / math.sqrt(k))
        a_log = torch.empty(dims.num_value_heads, device=dev).uniform_(1.0, 16.0).log()
        rows = conv_rows_for_rank(dims, tp, rank).to(conv.device)
        self.conv_weight = torch.nn.Parameter(conv.index_select(0, rows).unsqueeze(1).to(dtype))  # [C/tp, 1, K]
        self.A_log = torch.nn.Parameter(a_log[rank * self.n_v:(rank + 1) * self.n_v].to(dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.n_v, device=dev, dtype=dtype))
        self.out_norm_weight = torch.nn.Parameter(torch.ones(dims.value_head_dim, device=dev, dtype=dtype))
        for p in (self.conv_weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict:
        """Dist-checkpoint tensors, resharding across TP sizes (``model/gdn_ckpt.py``)."""
        from megatron_maspo.model.gdn_ckpt import gdn_sharded_state_dict

        return gdn_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                packed_seq_params: Any = None, inference_context: Any = None, **_: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` → ``([s, b, h], None)``; packed (thd, b = 1) when ``packed_seq_params`` is given.

        ``attention_mask`` is ignored: the mixer is causal by construction, and sequences are told
        apart by ``packed_seq_params`` (thd) or by the batch rows (sbhd).
        """
        if inference_context is not None:
            raise ValueError("GatedDeltaNet has no Megatron inference path: generate with the built-in "
                             "engine (transformers' cache) or vLLM")
        proj, _ = self.in_proj(hidden_states)                                   # [s, b, P/tp]
        s, b = proj.shape[0], proj.shape[1]
        if packed_seq_params is not None:
            if b != 1:
                raise ValueError(f"packed linear attention needs batch 1, got {b}")
            from megatron_maspo.model.packed_attention import packed_bounds

            bounds, x = packed_bounds(packed_seq_params), proj[:, 0]
        else:  # rows are independent sequences
            bounds, x = list(range(0, s * b + 1, s)), proj.transpose(0, 1).reshape(s * b, -1)
        q, k, v, z, beta, a = x.split(self.parts, dim=-1)
        dk, dv = self.dims.key_head_dim, self.dims.value_head_dim
        nq = self.parts[0] + self.parts[1]
        qkv = packed_causal_conv1d(torch.cat([q, k, v], dim=-1), self.conv_weight[:, 0], bounds)
        rep = self.n_v // self.n_k
        q = qkv[:, :self.parts[0]].reshape(-1, self.n_k, dk).repeat_interleave(rep, dim=1)
        k = qkv[:, self.parts[0]:nq].reshape(-1, self.n_k, dk).repeat_interleave(rep, dim=1)
        v = qkv[:, nq:].reshape(-1, self.n_v, dv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = chunk_gated_delta_rule(q, k, v, g, beta.sigmoid(), bounds, backend=self.dims.backend,
                                   chunk_size=self.dims.chunk_size)             # [T, n_v/tp, d_v]
        w = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group)
        o = gated_rmsnorm(o, z.reshape(-1, self.n_v, dv), w, self.config.layernorm_epsilon)
        o = o.reshape(-1, self.n_v * dv).to(hidden_states.dtype)
        o = o.unsqueeze(1) if packed_seq_params is not None else o.reshape(b, s, -1).transpose(0, 1)
        out, bias = self.out_proj(o)
        return out, bias
