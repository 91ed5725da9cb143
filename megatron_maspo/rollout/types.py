"""The engine protocol every rollout backend implements, and the plain data it exchanges.

Kept free of heavy imports: the trainer, the evaluator and the tests depend on this module only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample completions for one ``generate`` call."""

    n: int = 1
    """Completions per prompt (the group size G for GRPO-style methods)."""
    temperature: float = 1.0
    """Softmax temperature T; 0 means greedy. Rollout log-probs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus mass; keep 1.0 for RL so rollout and trainer log-probs share a support (weight-sync-notes.md §2)."""
    max_tokens: int = 64
    """Maximum new tokens per completion."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after emitting any of these (the stop token is kept in ``token_ids``)."""
    seed: int | None = None
    """Base seed; with a seed, generation is deterministic for the same prompts and weights."""
    first_prompt: int = 0
    """Position of ``prompts[0]`` in the step's whole prompt list. The built-in engine seeds per prompt
    and sample from ``first_prompt + i``, so a prompt's samples do not depend on how the fleet splits the
    step; vLLM seeds the whole call once from ``(seed, first_prompt)`` (``sampling.batch_seed``), so its
    engines draw distinct streams and a prompt's samples depend on the batch it is in (docs/rollout.md)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.first_prompt < 0:
            raise ValueError(f"SamplingParams.first_prompt must be >= 0, got {self.first_prompt}")


@dataclass(kw_only=True)
class Completion:
    """One sampled response."""

    token_ids: list[int]
    """Generated token ids (prompt excluded; the stop token included when one fired)."""
    logprobs: list[float]
    """Per-token log-prob of each generated token under the engine's (temperature-scaled) distribution."""
    finish_reason: str
    """``"stop"`` (a stop token fired) or ``"length"`` (``max_tokens`` reached)."""
    policy_version: int = 0
    """Version of the weights that produced this completion (incremented by every weight sync)."""
    token_versions: list[int] | None = None
    """In-flight updates only: the weight version each token was sampled with (``policy_version`` is then
    the first token's); None when one version made the whole response."""
    routed_experts: torch.Tensor | None = None
    """MoE routing replay (``model.routing_replay``): ``[P + n - 1, num_moe_layers, top_k]`` int16
    tensor of the experts the engine chose at every prompt position and every fed-back generated
    token (``rollout/routing.py``); None when the engine does not record routing."""


@runtime_checkable
class WeightSink(Protocol):
    """What a weight sync loads into (``rollout/weight_sync.py::sync_weights``): an engine, or the
    disaggregated sender that forwards each bucket to the rollout pool (``pool_sync.WeightSender``)."""

    def bucket_pool(self, bucket_bytes: int) -> Any:
        """Reusable buffers the sync packs into (a ``transport.BucketPool``: packing bucket k+1 overlaps
        loading bucket k, and buffers are shared without copies), or None for fresh host buffers."""
        ...

    def load_buckets(self, buckets: Iterable[Any], *, verify: bool = True) -> None:
        """Consume one sync's buckets (``buckets.Bucket``) in stream order; ``verify``: check each crc32."""
        ...

    @property
    def policy_version(self) -> int:
        """Syncs completed (0 = the initial weights)."""
        ...


@runtime_checkable
class Engine(WeightSink, Protocol):
    """A rollout engine: generates from token ids and accepts new weights by HF checkpoint name or as
    packed buckets (:class:`WeightSink`). Its traits (TP, in-flight updates, routing replay, how its
    workers receive weights) are in ``rollout/engines.py``, not on the instance.
    """

    device: Any
    """Where buckets for this engine are received in a disaggregated rollout pool (a ``torch.device``)."""
    label: str
    """Names the engine in errors (``"builtin engine 1"``)."""
    verify_s: float
    """Seconds the last sync's digest verification took (``rollout/digest.py``; 0 when not verified)."""
    verify_full_s: float | None
    """Seconds of the last verification that digested every tensor in full (None before one)."""
    defer_verify: bool
    """Leave the digest check of a load to :meth:`deferred_check` (run beside generation); engines that
    cannot (vLLM: its workers are inside ``generate``) keep it False and check inside ``load_buckets``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; returns ``[P][n]`` completions.

        ``progress(k)``, when given, is called as ``k`` more sequences finish (``P·n`` in all).
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights with full HF-named tensors (any order, each name once).

        After it returns, every later ``generate`` uses exactly the new weights (caches reset).
        """
        ...

    def sleep(self, level: int = 1) -> None:
        """Release memory for colocation (1: offload weights, drop KV cache; 2: drop both)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``sleep``: all of it (None), or only ``"weights"`` / ``"kv_cache"`` (vLLM's tags). The trainer
        wakes the weights for the sync and the KV cache only once its own state is offloaded
        (``train/actor/offload.py::STEP_PHASES``); ``generate`` wakes whatever is still asleep."""
        ...

    def staging_pool(self) -> Any:
        """Where a rollout-pool owner receives each bucket for this engine (a ``transport.StagingPool``
        of host shared memory that its workers map), or None for plain buffers on :attr:`device`."""
        ...

    def shutdown(self) -> None:
        """Stop the engine's processes now (no-op for an in-process engine)."""
        ...

    def deferred_check(self) -> Callable[[], None] | None:
        """With ``defer_verify``: the last load's digest check (raises ``WeightVerifyError``), or None."""
        ...

    def inject_fault(self, kind: str, name: str | None = None) -> None:
        """Failure tests: after the next sync's load, corrupt (``"flip"``) or restore to its previous
        value (``"stale"``) one parameter, so that the digest verification must stop the sync."""
        ...
