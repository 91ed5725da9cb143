"""Generation time of one synchronous rollout phase, with the straggler tail (pure maths, no I/O).

A synchronous RL step waits for its longest response. Per engine (``vllm_tp`` GPUs, one bf16 copy of the
weights), continuous batching keeps up to ``conc`` sequences in flight (bounded by the KV cache); every
decode step reads the weights once and, for each live sequence, its KV context. With ``n`` sequences per
engine, mean response ``m``, tail ``T`` (the longest response of the engine's batch) and
``waves = ceil(n / conc)``:

    steps        = (waves - 1) * m + T                 earlier waves end with their mean (the scheduler
                                                       refills free slots), the last lasts the tail
    weight reads = steps_full * W_full + (T - m)+ * W_tail
                   W_full = 2 P / vllm_tp (dense; MoE: dense part + experts touched by ``conc`` tokens),
                   W_tail = the same for the few stragglers (MoE: the top-k experts of one token)
    KV reads     = n * m * (p + m / 2) * kv_token_bytes each generated token reads its context
    decode       = (weight reads + KV reads) / (HBM * decode_eff)
    prefill      = n * p * 2 P_act / (vllm_tp * peak * mfu)
    generation   = prefill + max(decode, n * m * 2 P_act / (vllm_tp * peak * mfu))

Summing KV reads per generated token rather than per step makes the formula hold for any length
distribution inside a wave: the number of sequences alive at step k falls as responses finish, and the
sum over steps of the live count is the number of generated tokens. Engines decode in parallel, so the
phase lasts as long as one engine's share. The engine count is ``world / vllm_tp`` (the rollout-fleet
design); see docs/planner-calibration.md for what the trainer builds today.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """One engine's share of a rollout phase and the model figures decode time depends on."""

    seqs: int
    """Sequences this engine generates (n)."""
    conc: int
    """Sequences in flight at once (KV-cache bound, <= seqs)."""
    prompt: float
    """Mean prompt tokens (p)."""
    mean: float
    """Mean response tokens (m)."""
    tail: float
    """Longest response of the engine's batch, tokens (T >= m)."""
    weight_bytes_full: float
    """Weight bytes one decode step reads per engine GPU at full concurrency."""
    weight_bytes_tail: float
    """Weight bytes per step while only the stragglers decode."""
    kv_token_bytes: float
    """K and V bytes of one context token per engine GPU."""
    active_params: float
    """Parameters touched per token (P_act) for the FLOP bound and prefill."""
    vllm_tp: int


def exponential_expected_max(mean: float, n: int) -> float:
    """Expected longest of ``n`` exponentially distributed lengths with mean ``mean``: mean x H_n.

    Not the planner's default tail: docs/planner-calibration.md shows it under-estimates a published
    16k run 3x (RL responses have heavier tails: some run to the budget).
    """
    return mean * sum(1.0 / k for k in range(1, max(1, n) + 1))


def moe_touched_fraction(tokens: float, num_experts: int, topk: int) -> float:
    """Expected fraction of experts at least one of ``tokens`` tokens routes to (uniform routing)."""
    return 1.0 - (1.0 - topk / num_experts) ** max(1.0, tokens)


def generation_seconds(load: EngineLoad, *, hbm_tb_s: float, decode_eff: float, peak_tflops: float,
                       mfu: float) -> float:
    """Seconds one engine needs for its share (module docstring formula)."""
    n, m, tail, p = load.seqs, load.mean, max(load.tail, load.mean), load.prompt
    waves = math.ceil(n / max(1, load.conc))
    steps_full = (waves - 1) * m + m
    weights = steps_full * load.weight_bytes_full + (tail - m) * load.weight_bytes_tail
    kv = n * m * (p + m / 2) * load.kv_token_bytes
    decode = (weights + kv) / (hbm_tb_s * 1e12 * decode_eff)
    flops_rate = load.vllm_tp * peak_tflops * 1e12 * mfu
    prefill = n * p * 2 * load.active_params / flops_rate
    return prefill + max(decode, n * m * 2 * load.active_params / flops_rate)
