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
    KV reads     = n * (p m + E[L^2] / 2) * kv_token_bytes   each generated token reads its context; the
                   sum over a response of length L of its context is p L + L^2 / 2, so the cost follows the
                   second moment of the lengths, not the mean alone (see ``length_second_moment``)
    decode       = steps * step_fixed + (weight reads + KV reads) / (HBM * decode_eff)
                   step_fixed: what a decode step costs besides its reads (scheduler, sampling, input
                   preparation, kernel launches), the same for a 1.5B and a 70B engine
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
    comm_step_s: float = 0.0
    """An engine spanning nodes: fixed cost of one decode step's TP all-reduces across nodes
    (:func:`cross_node_allreduce`); 0 inside a node (NVLink all-reduces are in ``step_fixed``)."""
    comm_token_s: float = 0.0
    """An engine spanning nodes: seconds of all-reduce traffic across nodes per token (decode and prefill)."""


def exponential_expected_max(mean: float, n: int) -> float:
    """Expected longest of ``n`` exponentially distributed lengths with mean ``mean``: mean x H_n.

    Not the planner's default tail: docs/planner-calibration.md shows it under-estimates a published
    16k run 3x (RL responses have heavier tails: some run to the budget).
    """
    return mean * sum(1.0 / k for k in range(1, max(1, n) + 1))


def length_second_moment(mean: float, tail: float) -> float:
    """E[L^2] of response lengths with mean ``mean`` bounded by ``tail`` (tokens^2).

    The lengths are taken as the maximum-entropy distribution on [0, tail] with that mean: an exponential
    truncated at the tail (rate 0, the uniform, when the mean is half the tail; no spread when mean = tail).
    A light-tailed mean-m guess alone (L = m for every response) under-counts the KV reads of long
    responses: with the mean far below the tail, E[L^2] approaches 2 m^2, twice the spread-free m^2.
    """
    if tail <= 0 or mean >= tail:
        return mean * mean
    if mean <= 0:
        return 0.0
    x = mean / tail
    if x > 0.5:  # lengths crowd at the tail: reflect (u -> 1 - u) onto a mean below half
        return tail * tail * (1 - 2 * (1 - x) + _unit_second_moment(1 - x))
    return tail * tail * _unit_second_moment(x)


def _unit_second_moment(x: float) -> float:
    """E[u^2] of the density ~ exp(-r u) on [0, 1] whose mean is ``x`` (0 < x <= 1/2, so r >= 0)."""
    def mean_of(r: float) -> float:
        return 0.5 if r < 1e-9 else 1 / r - (1 / math.expm1(r) if r < 700 else 0.0)

    lo, hi = 0.0, max(1.0, 2 / x)  # mean_of falls from 1/2 (r = 0) to below x (r = 2 / x)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_of(mid) > x else (lo, mid)
    r = (lo + hi) / 2
    if r < 1e-6:
        return 1 / 3
    # E[u^2] = (2/r^2 - e^{-r} (1 + 2/r + 2/r^2)) / (1 - e^{-r})
    return (2 / r**2 - math.exp(-r) * (1 + 2 / r + 2 / r**2)) / -math.expm1(-r)


def moe_touched_fraction(tokens: float, num_experts: int, topk: int) -> float:
    """Expected fraction of experts at least one of ``tokens`` tokens routes to (uniform routing)."""
    return 1.0 - (1.0 - topk / num_experts) ** max(1.0, tokens)


def generation_seconds(load: EngineLoad, *, hbm_tb_s: float, decode_eff: float, peak_tflops: float,
                       mfu: float, step_fixed_s: float = 0.0, tail_overlapped: bool = False) -> float:
    """Seconds one engine needs for its share (module docstring formula).

    ``tail_overlapped``: the engine does not wait for its batch's stragglers before the next batch
    (``rollout.in_flight_updates``: an unfinished response continues into the next batch's decode steps,
    under the new weights). The ``T - m`` steps in which only stragglers decode leave the batch's time; their
    tokens still cost their KV reads (they ride along in later steps), so only the steps' fixed cost and
    weight reads go.
    """
    n, m, tail, p = load.seqs, load.mean, max(load.tail, load.mean), load.prompt
    waves = math.ceil(n / max(1, load.conc))
    steps_full = (waves - 1) * m + m
    tail_steps = 0.0 if tail_overlapped else tail - m
    weights = steps_full * load.weight_bytes_full + tail_steps * load.weight_bytes_tail
    kv = n * (p * m + length_second_moment(m, tail) / 2) * load.kv_token_bytes
    decode = (steps_full + tail_steps) * (step_fixed_s + load.comm_step_s) + n * m * load.comm_token_s \
        + (weights + kv) / (hbm_tb_s * 1e12 * decode_eff)
    flops_rate = load.vllm_tp * peak_tflops * 1e12 * mfu
    prefill = n * p * (2 * load.active_params / flops_rate + load.comm_token_s)
    return prefill + max(decode, n * m * 2 * load.active_params / flops_rate)


def cross_node_allreduce(*, hidden: int, layers: int, vllm_tp: int, gpus_per_node: int, latency_us: float,
                         internode_gb_s: float, elt: int = 2) -> tuple[float, float]:
    """``(per_step_s, per_token_s)``: what the TP all-reduces of an engine spanning ``k = vllm_tp /
    gpus_per_node`` nodes cost per decode step and per token; ``(0, 0)`` inside one node.

    Each layer all-reduces its attention output and its MLP / MoE output: ``2 L`` all-reduces per forward,
    each of ``tokens x hidden x elt`` bytes. Across nodes NCCL reduces inside each node, then runs a ring
    over the ``k`` nodes on every GPU's NIC at once (each carries ``1 / gpus_per_node`` of the message):

        per step   = 2 L * 2 k * latency                  a reduce-scatter and an all-gather ring: 2k hops
        per token  = 2 L * hidden * elt * 2 (k - 1) / k / (gpus_per_node * internode_gb_s)

    Small decode messages are latency bound, so an engine across nodes decodes each step several
    milliseconds slower than one inside a node; the term is why such engines pay off only where the
    weights leave no KV cache inside one node.
    """
    if vllm_tp <= gpus_per_node:
        return 0.0, 0.0
    k = vllm_tp / gpus_per_node
    per_step = 2 * layers * 2 * k * latency_us * 1e-6
    per_token = 2 * layers * hidden * elt * 2 * (k - 1) / k / (gpus_per_node * internode_gb_s * 1e9)
    return per_step, per_token


def cross_node_relay_seconds(weight_bytes: float, *, vllm_tp: int, gpus_per_node: int,
                             internode_gb_s: float) -> float:
    """Seconds a sync spends relaying every bucket from the engine's first node to its other nodes (the
    workers there cannot map the first node's buffers: ``rollout/transport.py::relay_bucket``, a broadcast
    over the engine's own TP group, pipelined, at one inter-node link's rate); 0 inside a node."""
    if vllm_tp <= gpus_per_node:
        return 0.0
    return weight_bytes / (internode_gb_s * 1e9)
