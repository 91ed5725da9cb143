"""Rollout engine and weight-sync settings."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("builtin", "vllm")
TRANSPORTS = ("ipc", "bytes")


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are sampled and how new weights reach the engine."""

    engine: str = "builtin"
    """``"builtin"`` (transformers + KV cache, the CPU default) or ``"vllm"``."""
    group_size: int = 8
    """Responses per prompt, G in GRPO/MASPO (paper: 8)."""
    temperature: float = 1.0
    """Sampling temperature T; the trainer divides logits by the same T for log-probs (loss-formulas.md §0.3)."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 keeps rollout and trainer log-probs on the same support."""
    max_new_tokens: int = 16
    """Maximum response length in tokens (paper: 8192)."""
    bucket_mb: float = 512.0
    """Weight-sync bucket size in MiB; one flat buffer per bucket."""
    verify_checksums: bool | None = None
    """Checksum (crc32) every bucket on the sender and verify it on the engine side. None = where it is
    cheap next to the transfer: the ``bytes`` transport and the built-in engine; off for the ``ipc``
    transport, where the worker maps the sender's buffer (crc32 would add two passes over the model on
    CPU, a device-to-host copy per bucket on GPU)."""
    weight_transport: str = "ipc"
    """vLLM only: ``"ipc"`` hands each bucket over as a shared buffer (shared memory on CPU, CUDA IPC on
    GPU; double-buffered); ``"bytes"`` (fallback) copies it into the RPC payload."""
    vllm_gpu_memory_utilization: float = 0.5
    """vLLM only: fraction of GPU memory for weights + KV cache (colocated with the trainer)."""
    vllm_cpu_kv_cache_mb: int = 512
    """vLLM on CPU only: KV-cache size in MiB. The CPU backend reads ``vllm_gpu_memory_utilization`` as a
    fraction of the whole NUMA node, which fails on a small node and grabs gigabytes on a big one; a fixed
    size starts anywhere with a few GB free (512 MiB holds 8192 fp32 tokens of SmolLM2-135M)."""
    vllm_tp: int = 1
    """vLLM only: the engine's own tensor-parallel size."""
    sleep_level: int = 2
    """Engine sleep between a rollout and the next weight sync (colocation): 2 drops weights and KV cache
    (they are re-synced anyway), 1 offloads weights and drops the KV cache."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine={self.engine!r}; accepted: {list(ENGINES)}")
        if self.weight_transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_transport={self.weight_transport!r}; accepted: {list(TRANSPORTS)}")
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for group advantages, got {self.group_size}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.bucket_mb <= 0:
            raise ValueError(f"rollout.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.vllm_cpu_kv_cache_mb < 1:
            raise ValueError(f"rollout.vllm_cpu_kv_cache_mb must be >= 1, got {self.vllm_cpu_kv_cache_mb}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level={self.sleep_level}; accepted: 1, 2")
