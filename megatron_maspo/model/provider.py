"""Turn an :class:`ArchSpec` into a Megatron-Core ``TransformerConfig`` and ``GPTModel`` chunks.

The Transformer Engine layer spec is used with ``attention_backend="te"`` (or ``use_te``); the local
spec otherwise (any machine: what builds does not depend on whether TE imports), whose core attention ``attention_backend`` picks:
``"packed_sdpa"`` (per-sequence fused SDPA, linear memory; ``model/packed_attention.py``) or
``"dense_mask"`` (Megatron's ``DotProductAttention``, ``[S, S]`` scores; the reference path).
Kernel fusions are on whenever CUDA is present and the kernel they need is installed
(:func:`fusion_options`), and off on CPU so results are exact there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_maspo.model import mcore_compat
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.device import on_cuda

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("packed_sdpa", "dense_mask", "varlen", "te")


@dataclass(kw_only=True)
class ModelBuildOptions:
    """How to instantiate a model (not what it is): parallel sizes, precision, recompute."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int | None = None
    pp_first_layers: int | None = None
    """Layers on the first / last pipeline stage (uneven split: ``parallel/pipeline_split.py``)."""
    pp_last_layers: int | None = None
    cp: int = 1
    """Context-parallel size: each packed row split over ``cp`` ranks (``context_parallel_size``)."""
    cp_comm_type: str = "p2p"
    """Transformer Engine's CP exchange (``"p2p"`` ring, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``);
    the local spec's ``packed_sdpa`` always all-gathers K/V."""
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    """fp16 parameters (``model.half()``), Megatron's fp16 mode; exclusive with ``bf16``."""
    recompute: str | None = None
    """None, ``"selective"`` (core attention) or ``"full"`` (uniform, 1 layer per block)."""
    make_vocab_size_divisible_by: int = 128
    use_te: bool | None = False
    """Build the TE spec (``attention_backend="te"`` forces it). The default is the local spec on every
    machine, as the trainer builds it with its default attention: a checkpoint's keys must not depend on
    whether TE happens to import (conversion reads the spec recorded with a checkpoint,
    ``model/spec_record.py``). None = TE spec if Transformer Engine imports (explicit opt-in only)."""
    attention_backend: str = "packed_sdpa"
    """Core attention of the local spec: ``"packed_sdpa"``, ``"dense_mask"`` or ``"varlen"`` (one varlen flash
    call per layer, GPU only); ``"te"`` = TE spec (its thd attention)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (TP > 1 only): activations outside attention/MLP split along the
    sequence over TP. The TE spec's norms support it; the local spec gets SP-aware torch norms
    (``model/sp_norm.py``). MoE needs it at TP > 1 (``parallel.config.sequence_parallel_on``)."""
    calculate_per_token_loss: bool = True
    """Megatron's exact global token-mean path (loss-formulas.md §2.2)."""
    use_cpu_initialization: bool = True
    """Draw full master weights on CPU and keep the local slice: identical weights at every TP. Only worth
    it when the random weights are kept; :func:`loaded_weights_options` turns it off when checkpoint or
    HF weights overwrite them (each rank then initialises only its own shard, on its device)."""
    init_method_std: float = 0.02
    moe_dispatcher: str = "alltoall"
    """MoE token dispatcher (``model/moe.py``): ``"alltoall"``, ``"allgather"`` or ``"flex"``."""
    moe_load_balancing: str = "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_fp32: bool = True
    """With ``bf16``: router weights stay fp32 and logits are computed in fp32."""
    routing_replay: bool = False
    """Build Megatron's ``RouterReplay`` into every router (``moe_enable_routing_replay``)."""
    moe_expert_bias_update: bool = False
    """Update the router's correction bias after each step (aux-loss-free rule); False = frozen."""
    moe_expert_bias_update_rate: float = 1e-3
    """Step of that update (``moe_router_bias_update_rate``)."""
    jit_fusions: bool = True
    """Megatron's compiled fusions where the machine has them (:func:`detected_fusion_options`: SwiGLU and
    bias-dropout through ``torch.compile`` on CUDA). The converter turns them off: its one verifying
    forward gains nothing from kernels it must first compile (a tiny model's ``convert --verify`` took
    57-70 s, CPU-bound, on an H200 against 9 s on the CPU bench; compiling is the likely share, not yet
    timed apart), and the unfused ops are the ones transformers runs."""


def attention_options(backend: str, tp: int) -> dict:
    """``ModelBuildOptions`` fields for ``model.attention_backend``, checked at start-up.

    ``"te"`` builds the TE spec with sequence parallelism at TP > 1 and fails here, before any
    weight is built, when Transformer Engine or CUDA is missing.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend={backend!r}; accepted: {ATTENTION_BACKENDS}")
    if backend == "te":
        from megatron_maspo.model.te_spec import require_te

        require_te()
    if backend == "varlen":
        from megatron_maspo.model.varlen_attention import require_varlen

        require_varlen()
    return {"attention_backend": backend, "use_te": backend == "te",
            "sequence_parallel": backend == "te" and tp > 1}


def padded_vocab_size(spec: ArchSpec, opts: ModelBuildOptions) -> int:
    """Rows of the vocab-parallel embedding: V rounded up to ``divisible_by * tp``."""
    return spec.padded_vocab_size(opts.tp, opts.make_vocab_size_divisible_by)


def fusion_options(has_cuda: bool, *, has_te: bool = False, has_softmax_kernel: bool = False,
                   has_grad_accum_kernel: bool = False) -> dict[str, bool]:
    """Megatron fusion flags for a machine: a pure function of what is available, so it is testable.

    Requirements in megatron-core 0.16.1:

    * ``bias_activation_fusion`` (SwiGLU) and ``bias_dropout_fusion``: TorchScript/torch.compile
      fusions inside megatron-core, no extension; CUDA only (CPU results stay unfused and exact).
    * ``masked_softmax_fusion``: the ``scaled_masked_softmax_cuda`` extension (Apex / Megatron's
      kernels); megatron-core imports it inside the forward, so the flag without it fails there.
    * ``apply_rope_fusion``: Transformer Engine's fused RoPE (``TransformerConfig`` refuses it without TE).
    * ``gradient_accumulation_fusion``: Apex's ``fused_weight_gradient_mlp_cuda`` (the linear layers
      raise without it).
    * ``persist_layer_norm`` stays off: it is Apex's LayerNorm kernel and the models use RMSNorm.
    """
    return {
        "bias_activation_fusion": has_cuda,
        "bias_dropout_fusion": has_cuda,
        "masked_softmax_fusion": has_cuda and has_softmax_kernel,
        "apply_rope_fusion": has_cuda and has_te,
        "gradient_accumulation_fusion": has_cuda and has_grad_accum_kernel,
        "persist_layer_norm": False,
    }


def detected_fusion_options() -> dict[str, bool]:
    """:func:`fusion_options` for this process: CUDA presence and installed kernels, probed by import spec."""
    from megatron_maspo.model.te_spec import te_available

    has_cuda = on_cuda()
    return fusion_options(
        has_cuda, has_te=has_cuda and te_available(),
        has_softmax_kernel=importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        has_grad_accum_kernel=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)


def uses_te(opts: ModelBuildOptions) -> bool:
    """Whether :func:`layer_spec` builds the Transformer Engine spec for ``opts``."""
    from megatron_maspo.model.te_spec import te_available

    if opts.attention_backend == "te":
        return True
    return te_available() if opts.use_te is None else bool(opts.use_te)


def moe_grouped_gemm(opts: ModelBuildOptions) -> bool:
    """Grouped-GEMM experts: on with the TE spec (``TEGroupedMLP``), off with the local spec
    (``SequentialMLP``); one value for the layer spec and the ``TransformerConfig``."""
    return uses_te(opts)


def loaded_weights_options(opts: ModelBuildOptions) -> ModelBuildOptions:
    """``opts`` for a model whose weights are overwritten right after the build (HF or Megatron weights,
    a reference copy): no full unsharded random draw on the CPU (``use_cpu_initialization=False``; for 7B
    that is every rank drawing all 7.6 B parameters on the CPU, then keeping 1/TP of them). The local
    shard is still initialised (on the device), so a parameter a loader missed is random, not garbage."""
    return dataclasses.replace(opts, use_cpu_initialization=False)


def build_transformer_config(spec: ArchSpec, opts: ModelBuildOptions):
    """Megatron ``TransformerConfig`` for ``spec`` under ``opts`` (after ``validate_layout``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec.validate_layout(opts.tp, opts.pp, opts.ep, opts.vpp, sequence_parallel=opts.sequence_parallel,
                         pp_first=opts.pp_first_layers, pp_last=opts.pp_last_layers)
    split = pipeline_split(spec, opts)
    on_gpu = on_cuda()
    kw: dict = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        layernorm_epsilon=spec.layernorm_epsilon,
        normalization="RMSNorm",
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        # MLA: the latent q/kv norms are what megatron-core calls qk_layernorm (0.19 resolves them from this
        # flag and refuses the norms without it; 0.16.1 reads the spec only)
        qk_layernorm=spec.qk_layernorm or spec.is_mla,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opts.init_method_std,
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=opts.vpp,
        expert_model_parallel_size=opts.ep,
        context_parallel_size=opts.cp,
        cp_comm_type=opts.cp_comm_type if opts.cp > 1 else None,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=opts.params_dtype,
        bf16=opts.bf16,
        fp16=opts.fp16,
        pipeline_dtype=torch.bfloat16 if opts.bf16 else torch.float16 if opts.fp16 else opts.params_dtype,
        use_cpu_initialization=opts.use_cpu_initialization,
        calculate_per_token_loss=opts.calculate_per_token_loss,
        **(detected_fusion_options() if opts.jit_fusions else fusion_options(False)),
        deallocate_pipeline_outputs=on_gpu,
        batch_p2p_comm=True,
        **split.megatron_kwargs(),
    )
    if spec.is_moe:
        from megatron_maspo.model.moe import moe_transformer_kwargs

        kw.update(moe_transformer_kwargs(spec, opts, grouped_gemm=moe_grouped_gemm(opts)))
    if spec.is_hybrid or spec.attention_output_gate or spec.moe_shared_expert_gate:
        from megatron_maspo.model.hybrid_spec import transformer_kwargs

        kw.update(transformer_kwargs(spec))
    if opts.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif opts.recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif opts.recompute is not None:
        raise ValueError(f"recompute={opts.recompute!r}; accepted: None, 'selective', 'full'")
    if spec.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from megatron_maspo.model.mla import mla_transformer_kwargs

        return MLATransformerConfig(**kw, **mla_transformer_kwargs(spec))
    return TransformerConfig(**kw)


def pipeline_split(spec: ArchSpec, opts: ModelBuildOptions):
    """The :class:`~megatron_maspo.parallel.pipeline_split.PipelineSplit` these options build."""
    from megatron_maspo.parallel.pipeline_split import PipelineSplit

    return PipelineSplit(spec.num_layers, opts.pp, opts.vpp, opts.pp_first_layers, opts.pp_last_layers)


def layer_spec(spec: ArchSpec, opts: ModelBuildOptions):
    """The transformer layer spec: TE when requested/available, else Megatron's local spec with the
    core attention ``opts.attention_backend`` names."""
    if opts.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={opts.attention_backend!r}; accepted: {ATTENTION_BACKENDS}")
    if uses_te(opts):
        from megatron_maspo.model.te_spec import te_layer_spec

        return te_layer_spec(spec, grouped_gemm=moe_grouped_gemm(opts))
    if spec.is_mla:
        from megatron_maspo.model.mla import mla_layer_spec

        lspec = mla_layer_spec(spec, grouped_gemm=moe_grouped_gemm(opts), core_attention=_core_attention(opts))
        if opts.sequence_parallel:  # the latent norms too: they see this rank's sequence chunk
            _use_sequence_parallel_norms(lspec)
        return lspec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    lspec = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=moe_grouped_gemm(opts),
                                     qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    if opts.sequence_parallel:  # torch norms whose weights finalize_model_grads sums over TP (model/sp_norm.py)
        _use_sequence_parallel_norms(lspec)
    core = _core_attention(opts)  # varlen: one flash call per layer (GPU; model/varlen_attention.py)
    if core is not None:
        attention: Any = lspec.submodules.self_attention  # type: ignore[attr-defined]
        attention.submodules.core_attention = core
    return lspec


def _core_attention(opts: ModelBuildOptions) -> type | None:
    """The local spec's core attention class for ``opts.attention_backend`` (None: Megatron's own)."""
    if opts.attention_backend == "packed_sdpa":
        from megatron_maspo.model.packed_attention import PackedSDPAttention

        return PackedSDPAttention
    if opts.attention_backend == "varlen":
        from megatron_maspo.model.varlen_attention import VarlenAttention

        return VarlenAttention
    return None


def _use_sequence_parallel_norms(lspec: Any) -> None:
    """Swap the local spec's norm builders (``WrappedTorchNorm``, which refuses SP) for
    :class:`~megatron_maspo.model.sp_norm.SequenceParallelTorchNorm` in place."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_maspo.model.sp_norm import SequenceParallelTorchNorm

    subs = lspec.submodules
    for owner, name in ((subs, "input_layernorm"), (subs, "pre_mlp_layernorm"),
                        (subs.self_attention.submodules, "q_layernorm"),
                        (subs.self_attention.submodules, "k_layernorm"),
                        (subs.self_attention.submodules, "kv_layernorm")):  # MLA's latent norms
        if getattr(owner, name, IdentityOp) not in (IdentityOp, None):
            setattr(owner, name, SequenceParallelTorchNorm)


def block_spec(spec: ArchSpec, opts: ModelBuildOptions, tcfg: Any, *, pp_rank: int, vp_stage: int | None):
    """The decoder spec of one model chunk: one layer spec for every layer, or, with dense first layers
    (``spec.moe_first_k_dense``), a ``TransformerBlockSubmodules`` holding this chunk's slice of
    ``[dense] * k + [moe] * (L - k)`` (Megatron's ``moe_layer_freq`` list; its own block-spec builder
    does not take our core-attention choice, so the slice is cut here with the same offset helpers)."""
    from megatron_maspo.model.hybrid_spec import needs_block_spec

    if needs_block_spec(spec):
        return _hybrid_block_spec(spec, opts, tcfg, pp_rank=pp_rank, vp_stage=vp_stage)
    lspec = layer_spec(spec, opts)
    local_sp = opts.sequence_parallel and not uses_te(opts)  # the final norm must be the SP one too
    if not local_sp and not (spec.is_moe and spec.moe_first_k_dense):
        return lspec
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    final_norm: Any = LayerNormImpl
    if local_sp:
        from megatron_maspo.model.sp_norm import SequenceParallelTorchNorm

        final_norm = SequenceParallelTorchNorm

    dense = layer_spec(dataclasses.replace(spec, num_moe_experts=None, moe_first_k_dense=0), opts) \
        if spec.is_moe and spec.moe_first_k_dense else lspec
    specs = [lspec if spec.is_moe_layer(i) or not spec.is_moe else dense for i in range(spec.num_layers)]
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    n = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + n], layer_norm=final_norm)


def _hybrid_block_spec(spec: ArchSpec, opts: ModelBuildOptions, tcfg: Any, *, pp_rank: int,
                       vp_stage: int | None) -> Any:
    """Per-layer specs for hybrid / zero-centred-norm models (``model/hybrid_spec.py``)."""
    from megatron_maspo.model.hybrid_spec import hybrid_block_spec

    if uses_te(opts):
        raise ValueError(f"ArchSpec(family={spec.family!r}) (linear attention / zero-centred norms) builds on "
                         "the local spec only: use model.attention_backend='packed_sdpa' or 'dense_mask'")
    if opts.sequence_parallel or (spec.is_moe and spec.moe_first_k_dense):
        raise ValueError(f"ArchSpec(family={spec.family!r}): sequence parallelism (on by default for MoE at TP > 1) "
                         "and dense first layers are not supported with linear attention / zero-centred norms "
                         "yet: use TP 1 with EP for the MoE models")
    return hybrid_block_spec(spec, tcfg, layer_spec(spec, opts), vp_stage=vp_stage, pp_rank=pp_rank)


def build_model_chunks(spec: ArchSpec, opts: ModelBuildOptions, *, pp_rank: int) -> list:
    """Build this rank's ``GPTModel`` chunk(s): one per virtual pipeline stage (one without VPP).

    Args:
        spec: the architecture.
        opts: parallel sizes and precision; must match Megatron's initialised parallel state.
        pp_rank: this rank's pipeline stage (decides pre/post processing).

    Returns:
        list of ``GPTModel`` with fp32 or bf16 parameters on the default device.
    """
    from megatron.core.models.gpt import GPTModel

    if spec.is_moe:
        mcore_compat.moe_router_without_te()  # a GPU without TE too, not only the CPU bench
    tcfg = build_transformer_config(spec, opts)
    vocab = padded_vocab_size(spec, opts)
    chunks = []
    n_vp = opts.vpp or 1
    for vp in range(n_vp):
        pre = pp_rank == 0 and vp == 0
        post = pp_rank == opts.pp - 1 and vp == n_vp - 1
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=block_spec(spec, opts, tcfg, pp_rank=pp_rank, vp_stage=vp if opts.vpp else None),
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=spec.rotary_percent,
            rotary_base=int(spec.rotary_base),
            rope_scaling=spec.rope_scaling == "llama3",
            rope_scaling_factor=spec.rope_scaling_factor if spec.rope_scaling == "llama3" else 8.0,
            seq_len_interpolation_factor=(spec.rope_scaling_factor if spec.rope_scaling == "linear"
                                          else None),
            vp_stage=vp if opts.vpp else None,
        )
        if on_cuda():
            model.cuda(torch.cuda.current_device())
        if opts.bf16 or opts.fp16:
            model.bfloat16() if opts.bf16 else model.half()
            if spec.is_moe and opts.moe_router_fp32:
                from megatron_maspo.model.moe import keep_router_fp32

                keep_router_fp32(model)
        chunks.append(model)
    return chunks
