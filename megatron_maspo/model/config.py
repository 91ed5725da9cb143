"""Which model to train and in what precision."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model."""

    source: str = "tiny"
    """``"tiny"`` (a built-in tiny Qwen2-style model with the byte tokenizer) or a path to a Hugging Face
    folder (config.json + safetensors + tokenizer) to warm-start from."""
    arch: str | None = None
    """Name of a built-in architecture preset (``megatron_maspo.model.presets``) describing ``source``
    when its config.json is not readable from this machine (planning, dry runs, cluster recipes)."""
    megatron_checkpoint: str | None = None
    """Optional Megatron dist-checkpoint to load the weights from instead of ``source``'s safetensors."""
    tiny_num_layers: int = 2
    """Layers of the built-in tiny model (``source="tiny"`` only)."""
    tiny_hidden_size: int = 64
    """Hidden size of the built-in tiny model (``source="tiny"`` only)."""
    bf16: bool = False
    """Train in bf16 with fp32 master weights (GPU); fp32 otherwise (the CPU default)."""
    fp16: bool = False
    """Train in fp16 with fp32 master weights and Megatron's loss scaler (``optim.loss_scale`` and
    friends), and roll out in fp16 (built-in engine and vLLM): fp16's 10 mantissa bits make trainer and
    engine agree more closely than bf16's 7 (arXiv 2510.26788). Exclusive with ``bf16``."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP; padded rows never enter the softmax."""
    recompute: str | None = None
    """Activation recompute: None, ``"selective"`` (core attention) or ``"full"``."""
    attention_backend: str = "packed_sdpa"
    """Attention over packed rows: ``"packed_sdpa"`` (causal SDPA per sequence, flash kernels on GPU and
    CPU, memory linear in the row length), ``"dense_mask"`` (Megatron's local attention with a
    ``[1, 1, S, S]`` block-causal mask and ``[heads, S, S]`` scores: the reference, small S only),
    ``"varlen"`` (one FlashAttention varlen call per layer, no host sync; CUDA only, written but not yet
    run on a GPU: ``model/varlen_attention.py``) or ``"te"`` (Transformer Engine spec, thd packing, sequence parallelism at TP > 1; needs CUDA and the
    ``te`` extra, checked when the model is built). Rotary positions restart at every sequence on the
    packed paths."""

    moe_dispatcher: str = "alltoall"
    """MoE token dispatcher: ``"alltoall"`` (Megatron's all-to-all-v over the EP group; the GPU
    default, and on CPU through a gloo shim), ``"allgather"`` (gathers every token to every EP rank;
    rows padded to equal length) or ``"flex"`` (DeepEP / HybridEP; GPU with ``deep_ep`` only)."""
    moe_load_balancing: str = "none"
    """Router load-balancing loss: ``"none"``, ``"aux_loss"`` (batch-level, GShard/Switch) or
    ``"seq_aux_loss"`` (per sequence, DeepSeek-V2/V3)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss added to the training loss (Qwen3-MoE pre-training: 1e-3)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss weight (ST-MoE; 1e-3 is a usual start); 0 disables it."""
    moe_expert_bias: bool = False
    """Update the router's score-correction bias during training with the aux-loss-free rule of
    DeepSeek-V3 (``b_i += rate * sign(mean load - load_i)`` after every step). False (default) keeps
    the bias the checkpoint has, frozen, as NeMo-RL's and verl's Megatron RL recipes do
    (``moe_router_bias_update_rate=0``). Only models with a correction bias (sigmoid routers:
    DeepSeek-V3, GLM-4.5) accept True."""
    moe_expert_bias_update_rate: float = 1e-3
    """Step of the correction-bias update (``moe_expert_bias=True`` only); DeepSeek-V3 pre-training: 1e-3."""
    moe_router_fp32: bool = True
    """Keep the router weights and logits in fp32 when the model trains in bf16 (top-k ties and
    near-ties then match an fp32 engine far more often)."""
    routing_replay: str = "off"
    """Replay the experts the rollout engine chose (MoE only): ``"off"``, ``"old_logprobs"`` (the
    old-log-prob pass routes as the engine did) or ``"all"`` (old-log-prob and training passes)."""

    @property
    def dtype_name(self) -> str:
        """Parameter / engine dtype: 'bfloat16', 'float16' or 'float32'."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    @property
    def torch_dtype(self):  # noqa: ANN201 - torch.dtype, torch imported lazily
        """``dtype_name`` as a torch dtype."""
        import torch

        return getattr(torch, self.dtype_name)

    def __post_init__(self) -> None:
        from megatron_maspo.model.moe import validate_moe_fields

        validate_moe_fields(self)
        if not self.source:
            raise ValueError("model.source must be 'tiny' or a Hugging Face folder path")
        if self.bf16 and self.fp16:
            raise ValueError("model.bf16 and model.fp16 are both true; choose one precision")
        if self.tiny_num_layers < 1 or self.tiny_hidden_size < 8 or self.tiny_hidden_size % 4:
            raise ValueError("model.tiny_num_layers must be >= 1 and model.tiny_hidden_size a multiple of 4 "
                             f">= 8, got {self.tiny_num_layers}, {self.tiny_hidden_size}")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"model.recompute={self.recompute!r}; accepted: None, 'selective', 'full'")
        if self.attention_backend not in ("packed_sdpa", "dense_mask", "varlen", "te"):
            raise ValueError(f"model.attention_backend={self.attention_backend!r}; accepted: "
                             "'packed_sdpa', 'dense_mask', 'varlen', 'te'")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("model.make_vocab_size_divisible_by must be >= 1")
