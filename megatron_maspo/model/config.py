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
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP; padded rows never enter the softmax."""
    recompute: str | None = None
    """Activation recompute: None, ``"selective"`` (core attention) or ``"full"``."""
    attention_backend: str = "packed_sdpa"
    """Attention over packed rows: ``"packed_sdpa"`` (causal SDPA per sequence, flash kernels on GPU and
    CPU, memory linear in the row length), ``"dense_mask"`` (Megatron's local attention with a
    ``[1, 1, S, S]`` block-causal mask and ``[heads, S, S]`` scores: the reference, small S only) or
    ``"te"`` (Transformer Engine spec, thd packing, sequence parallelism at TP > 1; needs CUDA and the
    ``te`` extra, checked when the model is built). Rotary positions restart at every sequence on the
    packed paths."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("model.source must be 'tiny' or a Hugging Face folder path")
        if self.tiny_num_layers < 1 or self.tiny_hidden_size < 8 or self.tiny_hidden_size % 4:
            raise ValueError("model.tiny_num_layers must be >= 1 and model.tiny_hidden_size a multiple of 4 "
                             f">= 8, got {self.tiny_num_layers}, {self.tiny_hidden_size}")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"model.recompute={self.recompute!r}; accepted: None, 'selective', 'full'")
        if self.attention_backend not in ("packed_sdpa", "dense_mask", "te"):
            raise ValueError(f"model.attention_backend={self.attention_backend!r}; accepted: "
                             "'packed_sdpa', 'dense_mask', 'te'")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("model.make_vocab_size_divisible_by must be >= 1")
