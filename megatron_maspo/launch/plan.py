"""Capacity planner: per-GPU memory and a rough step-time split for a recipe on a cluster (pure maths).

Memory (GiB = 2^30 bytes, per GPU, on the worst pipeline stage; P_l = parameters held by the GPU):

    weights     = P_l * (2 if bf16 else 4)
    grads       = P_l * 4                         fp32 grad buffer (Megatron accumulates bf16 grads in fp32)
    optimizer   = P_l * (12 if bf16 else 8) / d   fp32 main copy (bf16 only) + Adam m, v; d = DP x CP with the
                                                  distributed optimizer (expert params: d = DP x CP / EP), else 1
    activations = k * (L / pp) * N * a            N = train.max_tokens_per_micro_batch tokens per micro-batch,
                                                  k = micro-batches in flight on stage 0 (min(pp, #micro)),
                                                  a = bytes per token per layer (below)
    logprob     = min(B, N * V_pad / tp * (e + 8))  the fused log-prob workspace: B = train.logprob_chunk_bytes
                                                  (default 256 MiB), or less when the whole micro-batch fits
    engine      = u * M                           colocated vLLM: gpu_memory_utilization x GPU memory
                                                  (its weights 2 * P / vllm_tp + paged KV cache fill it)

    attention   = what model.attention_backend adds beyond ``activations`` (N = row length S, n_t = n_h/tp):
                  packed_sdpa / te: 0 (flash kernels: q, k, v, output, logsumexp are linear, in ``a``)
                  dense_mask: k * S^2                   [1, 1, S, S] bool mask per micro-batch in flight
                            + (k * L_saved + r) * p     p = (4 + e) n_t S^2 kept per layer for the backward:
                                                        fp32 softmax output + probs cast back (e < 4; fp32:
                                                        4 n_t S^2); L_saved = L/pp, r = 0 without recompute,
                                                        L_saved = 0, r = 1 (the layer being recomputed) with it
                            + (2e + 4) * n_t * S^2      running layer: persistent score buffer and baddbmm
                                                        output in the input dtype, fp32 upcast for softmax
                                                        (2e n_t S^2 in fp32)

    reference   = P_l * (2 if bf16 else 4)        the frozen reference model (train.reference_model)

    train peak   = weights + reference + grads + optimizer + activations + attention + logprob + reserve
    rollout peak = weights + reference + grads + optimizer - offloaded + engine + reserve
    sync peak    = weights + reference + grads + optimizer + engine weights + buckets + reserve

The phases are train/offload.py's ``STEP_PHASES``: the vLLM engine sleeps (level 1/2) during the update,
so its share and the trainer's activations never coexist; the trainer's state is offloaded *before* the
engine's KV cache wakes (and before the engine starts, when offload is on), so the rollout peak may
subtract it; the sync holds the whole trainer state, the engine's weights (2 P / vllm_tp) and, with
the ``ipc`` transport, two buckets (2 x rollout.bucket_mb) on the GPU. ``offloaded`` is what train.offload_params/grads/optimizer move to host memory during generation
(launch/plan_memory.py; 0 without offload). Context parallelism (parallel.cp, launch/plan_cp.py) splits
each row's N tokens over cp ranks: activations and the log-prob workspace are those of N / cp tokens.

Activation bytes per token per layer ``a`` (flash-style attention so no s^2 tensor, dropout 0 as in RL;
e = element bytes; Korthikanti et al. 2022 generalised to GQA and SwiGLU):

    none / selective:  e * (4h/s + (n_h d + 2 n_g d)/t + n_h d / t + 3F/t) + 4 n_h / t
    MoE MLP instead of 3F/t: top_k * (h + 3 F_moe) / t + 2E (fp32 router logits)
    full:              e * h / s  (layer input only; one layer's full set is added once for the recompute)

with s = t under sequence parallelism (attention_backend "te" at TP > 1), else 1.

Selective recompute (core attention) saves nothing measurable with flash attention, so it is modelled as
none. Step time (seconds per rollout step) from FLOPs and bandwidth, with the efficiencies of
:class:`Assumptions`:

    old-logprob = (F_fwd - F_exp) / (W * peak * mfu) + F_exp / (W * peak * moe_expert_mfu)
                  F_fwd = 2 P_act T + 2 L n_h d sum(s^2)  (x2 with a reference model; dense_mask:
                  4 L n_h d S T, every token scores the whole packed row); F_exp = 2 P_exp T, the routed
                  experts' share (0 for dense models), at its own, lower utilisation
    update      = (3 or 4 with full recompute) * old-logprob's per-forward time
    generation  = launch/plan_rollout.py: per engine, weight reads per decode step over (waves - 1) x mean
                  + tail steps, KV reads per generated token, at HBM x decode_bw_eff; the tail is the
                  longest response (Assumptions.response_max, else rollout.max_new_tokens)
    sync        = sync_fixed_s + 2 P / sync bandwidth
    offload     = 2 * offloaded bytes / host_gb_s     out before generation, back before the update
    context parallelism adds its exposed ring K/V exchange to old-logprob and update (launch/plan_cp.py)
    controller  = with Assumptions.controller_gb_s only: a single-controller framework's data shipping per
                  log-prob and train call, added to old-logprob and update (launch/plan_dispatch.py)

Response and prompt lengths default to fractions of their budgets; ``Assumptions.response_mean``,
``response_max`` and ``prompt_mean`` (``maspo plan --response-mean/--response-max/--prompt-mean``) set
them from a measured run. docs/planner-calibration.md compares the figures with published runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_maspo.launch.plan_cp import (
    TRAINER_REFUSES,
    RingLoad,
    ring_exposed_seconds,
    ring_link_gb_s,
)
from megatron_maspo.launch.plan_dispatch import step_dispatch_seconds
from megatron_maspo.launch.plan_memory import category_bytes, offloaded_bytes
from megatron_maspo.launch.plan_rollout import EngineLoad, generation_seconds, moe_touched_fraction
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel.logprobs_budget import DEFAULT_BUDGET_BYTES
from megatron_maspo.rollout.fleet import FleetLayout, build_fleet

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig

logger = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """Hardware figures and efficiencies the estimate rests on (defaults: H100-SXM-80G, performance-model.md §1)."""

    gpu_mem_gb: float = 80.0
    """Usable GPU memory in GiB."""
    peak_tflops: float = 989.0
    """Dense bf16 tensor peak per GPU (H100/H200 SXM)."""
    hbm_tb_s: float = 3.35
    """HBM bandwidth, TB/s (H100 3.35, H200 4.8)."""
    mfu: float = 0.35
    """Model-FLOPs utilisation of dense trainer forward/backward (RL update phases: 0.2-0.4)."""
    moe_expert_mfu: float = 0.03
    """Utilisation of the MoE expert FLOPs (token dispatch / all-to-all, grouped GEMMs on small experts,
    load imbalance). 0.03 puts Qwen3-30B-A3B's whole-model rate at ~56 TFLOP/s per GPU, inside the absolute
    rate verl reports for its Megatron MoE actor (MFU 0.31-0.40 of a 148 TFLOP/s H20, 46-59 TFLOP/s)."""
    decode_bw_eff: float = 0.45
    """Fraction of HBM bandwidth a decode step turns into useful weight + KV reads, all per-step costs
    (scheduling, sampling, log-prob return, kernel launch gaps) included; docs/planner-calibration.md."""
    sync_gb_s: float = 10.0
    """Weight-sync bandwidth the transport achieves, GB/s (published colocated refits: 3-15)."""
    sync_fixed_s: float = 3.0
    """Per-refit fixed cost: waking the engine, resetting its prefix cache, per-tensor metadata, seconds."""
    prompt_mean: float | None = None
    """Mean prompt tokens; None: ``prompt_frac`` x data.max_prompt_tokens."""
    response_mean: float | None = None
    """Mean response tokens; None: ``response_frac`` x rollout.max_new_tokens."""
    response_max: float | None = None
    """Longest response of one engine's batch (the straggler tail); None: rollout.max_new_tokens."""
    nvlink_gb_s: float = 150.0
    """Point-to-point bandwidth between GPUs of one node (context-parallel ring), GB/s."""
    internode_gb_s: float = 40.0
    """Point-to-point bandwidth between nodes per GPU (400 Gb/s InfiniBand at ~80%), GB/s."""
    host_gb_s: float = 20.0
    """Pinned host <-> GPU copy bandwidth per GPU for trainer offload (PCIe Gen5 x16, shared), GB/s."""
    p2p_latency_us: float = 20.0
    """Fixed cost of one ring hop (launch + synchronisation), microseconds."""
    controller_gb_s: float | None = None
    """A single controller's batch (de)serialisation rate, GB/s (launch/plan_dispatch.py); None: no controller."""
    reserve_gb: float = 3.0
    """CUDA context, NCCL buffers and allocator fragmentation, GiB."""
    engine_overhead_gb: float = 2.0
    """vLLM activations / CUDA graphs inside its memory share, GiB."""
    prompt_frac: float = 0.5
    """Average prompt length as a fraction of the prompt budget (data.max_prompt_tokens)."""
    response_frac: float = 0.5
    """Average response length as a fraction of ``rollout.max_new_tokens``."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The knobs the planner searches over."""

    tp: int
    pp: int
    ep: int = 1
    vpp: int | None = None
    recompute: str | None = None
    distributed_optimizer: bool = False
    vllm_tp: int = 1
    cp: int = 1


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Per-GPU memory in GiB (see the module docstring for each formula)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logprob: float
    engine: float
    reserve: float
    attention: float = 0.0
    """Attention memory beyond ``activations``: the dense-mask path's [S, S] tensors; 0 on packed paths."""
    attention_backend: str = "packed_sdpa"
    reference: float = 0.0
    """The frozen reference model's weights (train.reference_model), resident like the actor's."""
    offloaded: dict[str, float] = field(default_factory=dict)
    """GiB per GPU moved to host memory during generation, by offload category (launch/plan_memory.py)."""
    engine_weights: float = 0.0
    """The engine's weights alone (woken for the sync before its KV cache), GiB."""
    buckets: float = 0.0
    """The sync's double-buffered GPU buckets (``ipc`` transport), GiB."""

    @property
    def host(self) -> float:
        """Pinned host memory per GPU the offload needs, GiB."""
        return sum(self.offloaded.values())

    @property
    def train_peak(self) -> float:
        return (self.weights + self.reference + self.grads + self.optimizer + self.activations
                + self.attention + self.logprob + self.reserve)

    @property
    def rollout_peak(self) -> float:
        return (self.weights + self.reference + self.grads + self.optimizer - self.host + self.engine
                + self.reserve)

    @property
    def sync_peak(self) -> float:
        """The sync phase (train/offload.py::STEP_PHASES): trainer state resident, engine weights awake."""
        return (self.weights + self.reference + self.grads + self.optimizer + self.engine_weights
                + self.buckets + self.reserve)

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak, self.sync_peak)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per rollout step by phase."""

    generation: float
    old_logprob: float
    update: float
    sync: float
    offload: float = 0.0
    """Moving the offloaded training state to host memory and back (train.offload_*), seconds."""

    @property
    def total(self) -> float:
        return self.generation + self.old_logprob + self.update + self.sync + self.offload


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The outcome for one layout: figures, and why it is refused (empty ``reasons`` = fits)."""

    layout: Layout
    world: int
    dp: int
    memory: Memory | None = None
    time: StepTime | None = None
    kv_seqs: int = 0
    """Full-length sequences the engine's KV pool holds at once (per engine)."""
    engines: int = 0
    """Rollout engines the generation time assumes: ``fleet.num_engines`` (1 if the layout has none)."""
    fleet: FleetLayout | None = None
    """The trainer's engine layout for this plan (None when the world does not split into engines)."""
    tail: float = 0.0
    """Longest response per engine batch the generation time assumes, tokens."""
    prompts_per_step: int = 0
    transport: str = ""
    """``rollout.weight_transport`` (vLLM) or ``"in-process"`` (built-in engine)."""
    bucket_mb: float = 0.0
    gpus_per_node: int = 8
    reasons: list[str] = field(default_factory=list)

    @property
    def prompts_per_engine(self) -> int:
        """Prompt groups of the most loaded engine (whole groups of G responses)."""
        return max(self.fleet.shard_sizes(self.prompts_per_step)) if self.fleet else self.prompts_per_step

    @property
    def fits(self) -> bool:
        return not self.reasons


def arch_of(cfg: MaspoConfig) -> ArchSpec:
    """The architecture a config trains: ``model.arch`` preset, else the HF folder, else the tiny model."""
    from megatron_maspo.model.presets import get_preset

    if cfg.model.arch:
        return get_preset(cfg.model.arch)
    if cfg.model.source == "tiny":
        return tiny_qwen2_spec(num_layers=cfg.model.tiny_num_layers, hidden_size=cfg.model.tiny_hidden_size)
    if Path(cfg.model.source).is_dir():
        from megatron_maspo.model.hf_config import arch_spec_from_hf

        return arch_spec_from_hf(cfg.model.source)
    raise ValueError(f"model.source={cfg.model.source!r} is not readable here; set model.arch to a preset")


def layout_of(cfg: MaspoConfig) -> Layout:
    p = cfg.parallel
    return Layout(tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, recompute=cfg.model.recompute,
                  distributed_optimizer=p.distributed_optimizer, vllm_tp=cfg.rollout.vllm_tp, cp=p.cp)


def fleet_of(cfg: MaspoConfig, lay: Layout, world: int) -> FleetLayout | None:
    """The :class:`FleetLayout` the trainer would build for ``cfg`` with layout ``lay`` on ``world`` GPUs."""
    try:  # the config's own validation refuses layouts that do not divide the world: no fleet then
        p = dataclasses.replace(cfg.parallel, tp=lay.tp, pp=lay.pp, ep=lay.ep)
        cfg = dataclasses.replace(cfg, parallel=p, rollout=dataclasses.replace(cfg.rollout, vllm_tp=lay.vllm_tp))
        return build_fleet(cfg, world)
    except ValueError:
        return None  # refused elsewhere (vllm_tp or tp*pp does not divide the world)


def local_params(spec: ArchSpec, lay: Layout, divisible_by: int = 128) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one GPU of the worst pipeline stage."""
    h, t = spec.hidden_size, lay.tp
    nh, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    attn = (h * nh * d + 2 * h * g * d + nh * d * h) / t
    if spec.add_qkv_bias:
        attn += (nh * d + 2 * g * d) / t
    if spec.qk_layernorm:
        attn += 2 * d
    dense, expert = attn + 2 * h, 0.0
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        # experts are split over EP only: the trainer sets expert_tensor_parallel_size=1 (model/moe.py)
        expert = spec.num_moe_experts * 3 * h * spec.moe_ffn_hidden_size / lay.ep
        dense += h * spec.num_moe_experts
        if spec.moe_shared_expert_intermediate_size:
            dense += 3 * h * spec.moe_shared_expert_intermediate_size / t + h
    else:
        dense += 3 * h * spec.ffn_hidden_size / t
    layers = spec.num_layers // lay.pp
    emb = spec.padded_vocab_size(t, divisible_by) * h / t
    if lay.pp == 1:
        extra = emb * (1 if spec.tie_word_embeddings else 2) + h
    else:
        # Stage 0 holds the embedding, the last stage the output layer (a copy when tied) + final norm.
        extra = emb + h
    return layers * dense + extra, layers * expert


def activation_bytes(spec: ArchSpec, tp: int, recompute: str | None, elt: int,
                     sequence_parallel: bool = False) -> float:
    """Bytes kept per token per layer for the backward (module docstring formula)."""
    h, t = spec.hidden_size, tp
    sp = t if sequence_parallel else 1
    nh, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    if spec.is_moe:
        assert spec.moe_ffn_hidden_size and spec.num_moe_experts
        mlp = spec.moe_router_topk * (h + 3 * spec.moe_ffn_hidden_size) / t
        router = 4 * spec.num_moe_experts
    else:
        mlp, router = 3 * spec.ffn_hidden_size / t, 0
    full_set = elt * (4 * h / sp + (nh * d + 2 * g * d) / t + nh * d / t + mlp) + 4 * nh / t + router
    return elt * h / sp if recompute == "full" else full_set


def dense_attention_bytes(spec: ArchSpec, lay: Layout, seq: int, inflight: float, elt: int) -> float:
    """Bytes the dense block-causal-mask path adds per GPU for rows of ``seq`` tokens (module docstring)."""
    heads, s2 = spec.num_attention_heads / lay.tp, float(seq) ** 2
    upcast = 4 if elt < 4 else 0
    per_layer = (4 + elt if elt < 4 else 4) * heads * s2
    layers = inflight * (spec.num_layers // lay.pp) if lay.recompute is None else 1
    return inflight * s2 + layers * per_layer + (2 * elt + upcast) * heads * s2


def kv_bytes_per_token(spec: ArchSpec, vllm_tp: int) -> float:
    """bf16 K and V of all layers for one token on one engine GPU (KV heads replicate when vllm_tp > n_g)."""
    heads = max(1, math.ceil(spec.num_query_groups / vllm_tp))
    return 2 * spec.num_layers * heads * spec.kv_channels * 2


def active_params(spec: ArchSpec) -> float:
    """Parameters touched per token in a forward (LM head yes, embedding lookup no; top-k experts)."""
    p = spec.num_parameters()
    if not spec.tie_word_embeddings:
        p -= spec.vocab_size * spec.hidden_size
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        per_expert = 3 * spec.hidden_size * spec.moe_ffn_hidden_size
        p -= spec.num_layers * (spec.num_moe_experts - spec.moe_router_topk) * per_expert
    return float(p)


def expert_active_params(spec: ArchSpec) -> float:
    """Routed-expert parameters touched per token (top-k experts of every layer); 0 for dense models."""
    if not spec.is_moe:
        return 0.0
    assert spec.moe_ffn_hidden_size
    return float(spec.num_layers * spec.moe_router_topk * 3 * spec.hidden_size * spec.moe_ffn_hidden_size)


def _cp_ring(spec: ArchSpec, lay: Layout, row: int, seq: float, elt: int, hw: Assumptions,
             gpus_per_node: int) -> tuple[float, float]:
    """Exposed ring-attention seconds (forward, backward) per layer and micro-batch (launch/plan_cp.py)."""
    load = RingLoad(cp=lay.cp, row_tokens=row, seq_mean=min(seq, row), heads=spec.num_attention_heads,
                    kv_groups=spec.num_query_groups, head_dim=spec.kv_channels, tp=lay.tp, elt=elt)
    bw = ring_link_gb_s(lay.tp, lay.cp, gpus_per_node, intra_gb_s=hw.nvlink_gb_s, inter_gb_s=hw.internode_gb_s)
    return ring_exposed_seconds(load, link_gb_s=bw, latency_s=hw.p2p_latency_us * 1e-6,
                                flops_per_s=hw.peak_tflops * 1e12 * hw.mfu)


def estimate(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, *, nodes: int, gpus_per_node: int,
             hw: Assumptions | None = None) -> Plan:
    """Memory and time for ``cfg`` on ``nodes x gpus_per_node`` GPUs with layout ``lay``.

    Returns a :class:`Plan`; ``plan.reasons`` lists every violated constraint (empty when it fits).
    """
    hw = hw or Assumptions()
    world = nodes * gpus_per_node
    reasons: list[str] = []
    try:
        spec.validate_layout(lay.tp, lay.pp, lay.ep, lay.vpp,
                             sequence_parallel=cfg.model.attention_backend == "te" and lay.tp > 1)
    except ValueError as e:
        reasons.append(str(e))
    if spec.is_moe:
        from megatron_maspo.model.moe import moe_plan_reasons

        reasons += moe_plan_reasons(cfg, spec, lay.ep)
    if world % (lay.tp * lay.pp * lay.cp):
        what = "tp*pp" if lay.cp == 1 else "tp*pp*cp"
        reasons.append(f"world size {world} is not divisible by {what} = {lay.tp * lay.pp * lay.cp}")
        return Plan(layout=lay, world=world, dp=0, reasons=reasons)
    dp = world // (lay.tp * lay.pp * lay.cp)
    if lay.cp > 1:
        reasons.append(TRAINER_REFUSES.format(cp=lay.cp))
        if cfg.model.attention_backend != "te":
            reasons.append(f"parallel.cp={lay.cp} needs model.attention_backend='te' (ring attention is a "
                           f"TransformerEngine kernel), got {cfg.model.attention_backend!r}")
    if lay.tp > gpus_per_node:
        reasons.append(f"tp={lay.tp} spans nodes (gpus_per_node={gpus_per_node}); keep TP inside NVLink")
    if dp % lay.ep:
        reasons.append(f"data-parallel size {dp} is not divisible by ep={lay.ep}")
    if lay.vllm_tp > gpus_per_node or world % lay.vllm_tp:
        reasons.append(f"rollout.vllm_tp={lay.vllm_tp} must divide the world ({world}) within a node")
    tr, ro = cfg.train, cfg.rollout
    # Longer prompts are skipped by the data loader (data.*) or truncated (train.*): the smaller bounds.
    max_prompt = cfg.data.max_prompt_tokens
    seq_max = max_prompt + ro.max_new_tokens
    if seq_max > tr.max_tokens_per_micro_batch:
        reasons.append(f"train.max_tokens_per_micro_batch={tr.max_tokens_per_micro_batch} < max prompt + "
                       f"rollout.max_new_tokens = {seq_max}: a full-length sequence fits no micro-batch")
    if seq_max > spec.max_position_embeddings:
        reasons.append(f"sequence length {seq_max} exceeds max_position_embeddings={spec.max_position_embeddings}")
    seqs_per_mini = tr.prompts_per_step // tr.mini_batches_per_step * ro.group_size
    if seqs_per_mini < dp:
        reasons.append(f"{seqs_per_mini} sequences per mini-batch < dp={dp}: some ranks would get none")

    # --- memory -------------------------------------------------------------------------------------
    bf16 = cfg.model.bf16
    p_dense, p_expert = local_params(spec, lay, cfg.model.make_vocab_size_divisible_by)
    p_local = p_dense + p_expert
    opt_per_param = 12 if bf16 else 8
    d_dense = dp * lay.cp if lay.distributed_optimizer else 1  # Megatron shards over the dp x cp group
    d_expert = max(1, dp * lay.cp // lay.ep) if lay.distributed_optimizer else 1
    elt = 2 if bf16 else 4
    avg_prompt = hw.prompt_mean if hw.prompt_mean is not None else max_prompt * hw.prompt_frac
    avg_resp = hw.response_mean if hw.response_mean is not None else ro.max_new_tokens * hw.response_frac
    tail = min(ro.max_new_tokens, hw.response_max if hw.response_max is not None else ro.max_new_tokens)
    if avg_resp > tail:
        reasons.append(f"mean response {avg_resp:.0f} tokens > longest response {tail:.0f}")
    avg_seq = avg_prompt + avg_resp
    tokens_per_rank_mini = seqs_per_mini * avg_seq / dp
    n_micro = max(1, math.ceil(tokens_per_rank_mini / tr.max_tokens_per_micro_batch))
    inflight = min(lay.pp, n_micro)
    if lay.vpp:
        inflight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    backend = cfg.model.attention_backend
    sp = backend == "te" and lay.tp > 1
    per_layer = activation_bytes(spec, lay.tp, lay.recompute, elt, sp)
    n_tok = tr.max_tokens_per_micro_batch // lay.cp  # this GPU's share of a row under context parallelism
    act = inflight * (spec.num_layers // lay.pp) * n_tok * per_layer
    if lay.recompute == "full":
        act += n_tok * activation_bytes(spec, lay.tp, None, elt, sp)
    act += n_tok * spec.hidden_size * elt / (lay.tp if sp else 1)  # final hidden states for the LM head
    attn = dense_attention_bytes(spec, lay, n_tok, inflight, elt) if backend == "dense_mask" else 0.0
    v_pad = spec.padded_vocab_size(lay.tp, cfg.model.make_vocab_size_divisible_by)
    budget = tr.logprob_chunk_bytes or DEFAULT_BUDGET_BYTES["cuda"]
    logprob = min(budget, n_tok * v_pad / lay.tp * (elt + 8))
    p_total = spec.num_parameters()
    engine_w = 2 * p_total / lay.vllm_tp
    if ro.engine == "vllm":
        engine = ro.vllm_gpu_memory_utilization * hw.gpu_mem_gb * GIB
        kv_pool = engine - engine_w - hw.engine_overhead_gb * GIB
    else:  # builtin engine: a bf16 copy plus KV for this rank's sequences at full length
        kv_pool = ro.group_size * tr.prompts_per_step / world * seq_max * kv_bytes_per_token(spec, 1)
        engine = engine_w + kv_pool
    has_ref = tr.reference_model or cfg.loss.kl_coef > 0  # the actor builds one in either case
    state = category_bytes(weights=p_local * elt, reference=p_local * elt if has_ref else 0.0,
                           grads=p_local * 4, optimizer=(p_dense / d_dense + p_expert / d_expert) * opt_per_param)
    off = offloaded_bytes(state, params=tr.offload_params, grads=tr.offload_grads,
                          optimizer=tr.offload_optimizer)
    mem = Memory(weights=p_local * elt / GIB, grads=state["grads"] / GIB, optimizer=state["optimizer"] / GIB,
                 activations=act / GIB, logprob=logprob / GIB, engine=engine / GIB,
                 reserve=hw.reserve_gb, attention=attn / GIB, attention_backend=backend,
                 reference=(state["params"] - p_local * elt) / GIB,
                 offloaded={c: b / GIB for c, b in off.items() if b}, engine_weights=engine_w / GIB,
                 buckets=(2 * ro.bucket_mb / 1024 if ro.engine == "vllm" and ro.weight_transport == "ipc"
                          else 0.0))
    if mem.peak > hw.gpu_mem_gb:
        why = (f"; model.attention_backend='dense_mask' holds {mem.attention:.1f} GiB of [S, S] attention "
               f"tensors at S={n_tok}: 'packed_sdpa' or 'te' are linear in S" if attn else "")
        reasons.append(f"needs {mem.peak:.1f} GiB per GPU > {hw.gpu_mem_gb:.0f} GiB (train peak "
                       f"{mem.train_peak:.1f}, rollout peak {mem.rollout_peak:.1f}, sync peak "
                       f"{mem.sync_peak:.1f}){why}")
    kvpt = kv_bytes_per_token(spec, lay.vllm_tp)
    kv_seqs = int(max(0.0, kv_pool) // (kvpt * seq_max))
    if kv_seqs < 1:
        reasons.append(f"the engine's KV pool ({kv_pool / GIB:.1f} GiB) holds no full-length sequence of "
                       f"{seq_max} tokens; raise rollout.vllm_gpu_memory_utilization or vllm_tp")

    # --- time -----------------------------------------------------------------------------------------
    n_seqs = tr.prompts_per_step * ro.group_size
    p_act = active_params(spec)
    f_fwd = 2 * p_act * n_seqs * avg_seq
    if backend == "dense_mask":  # the [S, S] scores cover the whole packed row, not the causal blocks
        f_fwd += 4 * spec.num_layers * spec.num_attention_heads * spec.kv_channels * n_tok * n_seqs * avg_seq
    else:
        f_fwd += 2 * spec.num_layers * spec.num_attention_heads * spec.kv_channels * avg_seq**2 * n_seqs
    f_exp = 2 * expert_active_params(spec) * n_seqs * avg_seq
    peak = world * hw.peak_tflops * 1e12
    fwd_s = (f_fwd - f_exp) / (peak * hw.mfu) + f_exp / (peak * hw.moe_expert_mfu)
    ring_f, ring_b = _cp_ring(spec, lay, tr.max_tokens_per_micro_batch, avg_seq, elt, hw, gpus_per_node)
    ring_fwd = ring_f * n_micro * tr.mini_batches_per_step * (spec.num_layers // lay.pp)
    ring_bwd = ring_b * n_micro * tr.mini_batches_per_step * (spec.num_layers // lay.pp)
    old_lp = (fwd_s + ring_fwd) * (2 if has_ref else 1)
    update = fwd_s * (4 if lay.recompute == "full" else 3) + ring_fwd * (2 if lay.recompute == "full" else 1) \
        + ring_bwd
    if hw.controller_gb_s:  # the batch, padded to its longest sequence, shipped to every tp*pp*cp rank
        lp_d, up_d = step_dispatch_seconds(seqs=n_seqs, padded_len=min(seq_max, avg_prompt + tail),
                                           replicas=lay.tp * lay.pp * lay.cp, reference=has_ref,
                                           controller_gb_s=hw.controller_gb_s)
        old_lp, update = old_lp + lp_d, update + up_d
    fleet = fleet_of(cfg, lay, world)  # the layout the trainer builds (rollout/fleet.py)
    engines = fleet.num_engines if fleet else 1
    per_engine = max(fleet.shard_sizes(tr.prompts_per_step)) * ro.group_size if fleet else n_seqs
    live = avg_prompt + avg_resp / 2
    conc = max(1, min(per_engine, int(max(0.0, kv_pool) // (kvpt * live))))
    w_full = w_tail = engine_w
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        e, k = spec.num_moe_experts, spec.moe_router_topk
        w_exp = 2 * spec.num_layers * e * 3 * spec.hidden_size * spec.moe_ffn_hidden_size / lay.vllm_tp
        w_full = engine_w - w_exp * (1 - moe_touched_fraction(conc, e, k))
        w_tail = engine_w - w_exp * (1 - moe_touched_fraction(1, e, k))
    load = EngineLoad(seqs=per_engine, conc=conc, prompt=avg_prompt, mean=avg_resp, tail=tail,
                      weight_bytes_full=w_full, weight_bytes_tail=w_tail, kv_token_bytes=kvpt,
                      active_params=p_act, vllm_tp=lay.vllm_tp)
    gen = generation_seconds(load, hbm_tb_s=hw.hbm_tb_s, decode_eff=hw.decode_bw_eff,
                             peak_tflops=hw.peak_tflops, mfu=hw.mfu)
    sync = hw.sync_fixed_s + 2 * p_total / (hw.sync_gb_s * 1e9)
    return Plan(layout=lay, world=world, dp=dp, memory=mem, kv_seqs=kv_seqs, reasons=reasons,
                engines=engines, tail=tail, fleet=fleet, prompts_per_step=tr.prompts_per_step,
                transport=ro.weight_transport if ro.engine == "vllm" else "in-process", bucket_mb=ro.bucket_mb,
                gpus_per_node=gpus_per_node,
                time=StepTime(generation=gen, old_logprob=old_lp, update=update, sync=sync,
                              offload=2 * sum(off.values()) / (hw.host_gb_s * 1e9)))


def _divisors(n: int, cap: int) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0]


def suggest(cfg: MaspoConfig, spec: ArchSpec, *, nodes: int, gpus_per_node: int,
            hw: Assumptions | None = None) -> Plan | None:
    """The fitting layout nearest to the config's: fewest changed knobs, then the fastest step."""
    base = layout_of(cfg)
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    pps = _divisors(spec.num_layers, 16)
    eps = _divisors(spec.num_moe_experts, 64) if spec.is_moe else [1]
    best: tuple[tuple[int, float], Plan] | None = None
    for tp, pp, ep, rc, do, vtp in itertools.product(tps, pps, eps, (None, "selective", "full"),
                                                     (False, True), tps):
        lay = Layout(tp=tp, pp=pp, ep=ep, vpp=base.vpp if base.vpp and pp == base.pp else None,
                     recompute=rc, distributed_optimizer=do, vllm_tp=vtp)
        plan = estimate(cfg, spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
        if not plan.fits or plan.time is None:
            continue
        changed = sum(getattr(lay, f.name) != getattr(base, f.name) for f in dataclasses.fields(Layout))
        key = (changed, plan.time.total)
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1] if best else None


def apply_layout(cfg: MaspoConfig, lay: Layout) -> list[str]:
    """``--set`` overrides that turn ``cfg`` into layout ``lay`` (only the fields that differ)."""
    cur = layout_of(cfg)
    names = {"tp": "parallel.tp", "pp": "parallel.pp", "ep": "parallel.ep", "vpp": "parallel.vpp",
             "recompute": "model.recompute", "distributed_optimizer": "parallel.distributed_optimizer",
             "vllm_tp": "rollout.vllm_tp", "cp": "parallel.cp"}
    out = []
    for f in dataclasses.fields(Layout):
        new = getattr(lay, f.name)
        if new != getattr(cur, f.name):
            out.append(f"{names[f.name]}={'null' if new is None else str(new).lower()}")
    return out


def format_plan(plan: Plan, title: str = "") -> str:
    """A human-readable report of one plan."""
    lay = plan.layout
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    lines = [f"{title}world={plan.world} tp={lay.tp} pp={lay.pp}{cp} ep={lay.ep} dp={plan.dp} vpp={lay.vpp} "
             f"recompute={lay.recompute} distributed_optimizer={lay.distributed_optimizer} "
             f"vllm_tp={lay.vllm_tp}"]
    if plan.memory:
        m = plan.memory
        lines.append(f"  memory/GPU GiB: weights {m.weights:.1f}  grads {m.grads:.1f}  optimizer "
                     f"{m.optimizer:.1f}  activations {m.activations:.1f}  logprob-chunk {m.logprob:.2f}  "
                     f"engine {m.engine:.1f}  reserve {m.reserve:.1f}"
                     + (f"  reference {m.reference:.1f}" if m.reference else ""))
        quad = f"{m.attention:.1f} GiB [S, S] mask/scores/probs" if m.attention else "linear (in activations)"
        lines.append(f"  attention ({m.attention_backend}): {quad}")
        lines.append(f"  peak GiB: train {m.train_peak:.1f}  rollout {m.rollout_peak:.1f}  "
                     f"-> {m.peak:.1f}; KV pool holds {plan.kv_seqs} full-length sequences per engine")
        if m.offloaded:
            cats = "  ".join(f"{c} {g:.1f}" for c, g in m.offloaded.items())
            lines.append(f"  offloaded during generation GiB/GPU: {cats}; pinned host memory {m.host:.1f} GiB "
                         f"per GPU ({m.host * plan.gpus_per_node:.0f} GiB per node)")
    if plan.time:
        t = plan.time
        offload = f"  offload {t.offload:.1f}" if t.offload else ""
        lines.append(f"  step s: generation {t.generation:.0f}  old-logprob {t.old_logprob:.0f}  update "
                     f"{t.update:.0f}  sync {t.sync:.1f}{offload}  total {t.total:.0f}")
        fleet = plan.fleet.describe(plan.prompts_per_step) if plan.fleet else "1 engine (no fleet layout)"
        lines.append(f"  rollout fleet (as the trainer builds it): {fleet}; longest response {plan.tail:.0f} tokens")
        lines.append(f"  weight sync: transport {plan.transport}, buckets of {plan.bucket_mb:g} MiB")
    lines += [f"  REFUSED: {r}" for r in plan.reasons] or ["  fits"]
    return "\n".join(lines)
