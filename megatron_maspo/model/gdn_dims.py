"""Sizes of a Gated DeltaNet (linear-attention) mixer: plain data, no torch, so the planner, the
architecture spec and the layer read one definition (``gdn.GatedDeltaNet``, ``gdn_layout``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class GdnDims:
    """Sizes of one Gated DeltaNet mixer (HF ``linear_*`` config fields)."""

    num_key_heads: int
    """``n_k`` (HF ``linear_num_key_heads``)."""
    num_value_heads: int
    """``n_v`` (HF ``linear_num_value_heads``), a multiple of ``n_k``."""
    key_head_dim: int
    """``d_k`` (HF ``linear_key_head_dim``)."""
    value_head_dim: int
    """``d_v`` (HF ``linear_value_head_dim``)."""
    conv_kernel: int = 4
    """``K`` (HF ``linear_conv_kernel_dim``)."""
    chunk_size: int = 64
    """Chunk length of the torch kernel (numerics only; fla uses its own)."""
    backend: str = "auto"
    """``gdn_kernels.BACKENDS``: ``auto`` = fla on CUDA when installed, else torch."""

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel",
                     "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GdnDims.{name} must be > 0, got {getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"GdnDims.num_value_heads={self.num_value_heads} is not a multiple of "
                             f"num_key_heads={self.num_key_heads}")

    @classmethod
    def from_hf(cls, cfg: Any, **overrides: Any) -> GdnDims:
        """Read the ``linear_*`` fields of a transformers Qwen3.5 text config."""
        return cls(num_key_heads=cfg.linear_num_key_heads, num_value_heads=cfg.linear_num_value_heads,
                   key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
                   conv_kernel=cfg.linear_conv_kernel_dim, **overrides)

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` unless ``tp`` divides the key heads (hence the value heads)."""
        if self.num_key_heads % tp:
            raise ValueError(f"linear attention: num_key_heads={self.num_key_heads} is not divisible by "
                             f"tensor_model_parallel_size={tp}")

    def part_sizes(self, tp: int = 1) -> tuple[int, int, int, int, int, int]:
        """Rows of one rank's fused input projection: ``(q, k, v, z, b, a)``."""
        nk, nv = self.num_key_heads // tp, self.num_value_heads // tp
        qk, vd = nk * self.key_head_dim, nv * self.value_head_dim
        return qk, qk, vd, vd, nv, nv

    def conv_channels(self, tp: int = 1) -> int:
        """Conv channels of one rank: ``q | k | v``."""
        return sum(self.part_sizes(tp)[:3])

    def num_parameters(self, hidden: int) -> int:
        """Weights of one mixer: fused input projection, conv, ``A_log``, ``dt_bias``, norm, output projection."""
        return (sum(self.part_sizes()) * hidden + self.conv_channels() * self.conv_kernel
                + 2 * self.num_value_heads + self.value_head_dim + self.num_value_heads * self.value_head_dim * hidden)

    def recurrent_state_numel(self) -> int:
        """Elements one sequence holds in one layer while decoding: delta state + conv window."""
        return self.delta_state_numel() + self.conv_state_numel()

    def delta_state_numel(self) -> int:
        """Elements of one sequence's delta-rule state in one layer: ``n_v · d_k · d_v``."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    def conv_state_numel(self) -> int:
        """Elements of one sequence's conv window in one layer: ``C · (K − 1)``."""
        return self.conv_channels() * (self.conv_kernel - 1)

    def decode_state_bytes(self, conv_bytes: int) -> int:
        """Bytes one sequence holds in one layer while decoding: the delta state in fp32 (transformers,
        fla and vLLM keep it in fp32 whatever the model dtype) and the conv window at ``conv_bytes``."""
        return 4 * self.delta_state_numel() + conv_bytes * self.conv_state_numel()
