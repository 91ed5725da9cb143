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
                                                  (its weights 2 * P / vllm_tp + paged KV cache fill it;
                                                  rollout.vllm_quantization='fp8': 1 byte per linear weight,
                                                  model.py::engine_weight_bytes)

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

    (each term's megatron-core / vLLM source: launch/plan/memory.py; FP8 training is not modelled, a config
    asking for it is estimated as bf16 and the plan says so: ``FP8_TRAINING_NOTE``)

    train peak   = weights + reference + grads + optimizer + activations + attention + logprob + reserve
    rollout peak = the highest of, in the trainer's phase order (launch/plan/memory.py::ROLLOUT_PHASE_ORDER):
                   weights wake   state - offloaded grads/optimizer + engine weights
                   sync           the same + one bucket                   state = weights + reference
                   KV wake        state - offloaded + engine                      + grads + optimizer
                                                                                  + reserve

The vLLM engine sleeps (level 1/2) during the update, so its share and the trainer's activations never
coexist. ``offloaded`` is what train.offload_params/grads/optimizer move to host memory during generation
(launch/plan/memory.py; 0 without offload). Context parallelism (parallel.cp, launch/plan/cp.py) splits
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

    old-logprob = ((F_fwd - F_exp) / (W * peak * mfu') + F_exp / (W * peak * moe_expert_mfu)) * bubble
                  mfu' = mfu scaled by the GEMM shape (launch/plan/model.py::gemm_mfu: hidden / tp, micro-batch
                  tokens); bubble = 1 + (pp - 1) / (micro-batches x vpp), the 1F1B pipeline bubble
                  F_fwd = 2 P_act T + 2 L n_h d sum(s^2)  (sum(s^2) = n E[s^2], the lengths spread as in
                  generation: ``seq_second_moment``; x2 with a reference model; dense_mask:
                  4 L n_h d S T, every token scores the whole packed row); F_exp = 2 P_exp T, the routed
                  experts' share (0 for dense models), at its own, lower utilisation
    update      = (3 or 4 with full recompute) * old-logprob's per-forward time
    generation  = launch/plan/rollout.py: per engine, a fixed cost per decode step (decode_step_ms) plus
                  weight reads per decode step over (waves - 1) x mean
                  + tail steps, KV reads per generated token, at HBM x decode_bw_eff; the tail is the
                  longest response (Assumptions.response_max, else rollout.max_new_tokens)
    sync        = sync_fixed_s + 2 P / sync bandwidth
    offload     = 2 * offloaded bytes / host_gb_s     out before generation, back before the update
    grading     = responses of the most loaded engine / (reward.num_workers * grade_items_per_s)
    context parallelism adds its exposed ring K/V exchange to old-logprob and update (launch/plan/cp.py)
    expert parallelism adds the MoE token all-to-all, not overlapped, to both (launch/plan/moe_comm.py):
                  per pass L_moe (2 max(b (1 - f) / bw_nvlink, b f / bw_ib) + 3 M lat), b = t k h e (ep - 1) / ep,
                  t = n s / (dp cp tp) tokens per GPU, f = share of EP peers off-node; x2 in the update
                  (forward + backward), x3 with full recompute; moe_expert_mfu then covers only the grouped
                  GEMMs and load imbalance
    controller  = with Assumptions.controller_gb_s only: a single-controller framework's data shipping per
                  log-prob and train call, added to old-logprob and update (launch/plan/dispatch.py)

Response and prompt lengths default to fractions of their budgets; ``Assumptions.response_mean``,
``response_max`` and ``prompt_mean`` (``maspo plan --response-mean/--response-max/--prompt-mean``) set
them from a measured run. docs/planner-calibration.md compares the figures with published runs. A plan
refused on memory gets verdicts (launch/plan/verdict.py): each change that makes it fit, with its cost.

The disaggregated placement (rollout.placement=disaggregated: separate training and rollout pools) runs
these same phase models on each pool: launch/plan/disagg.py, and launch/plan/split.py for the comparison
of every split with the colocated plan (docs/disaggregated.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_maspo.launch.plan.cp import (
    RingLoad,
    cp_trainer_reasons,
    ring_exposed_seconds,
    ring_link_gb_s,
)
from megatron_maspo.launch.plan.memory import category_bytes, offloaded_bytes
from megatron_maspo.launch.plan.model import (
    activation_bytes,
    active_params,
    cache_bytes_per_sequence,
    dense_attention_bytes,
    engine_expert_bytes,
    engine_weight_bytes,
    expert_active_params,
    gemm_mfu,
    kv_bytes_per_token,
    local_params,
)
from megatron_maspo.launch.plan.moe_comm import a2a_seconds
from megatron_maspo.launch.plan.report import format_plan
from megatron_maspo.launch.plan.rollout import (
    EngineLoad,
    cross_node_allreduce,
    cross_node_relay_seconds,
    generation_seconds,
    length_second_moment,
    moe_touched_fraction,
)
from megatron_maspo.launch.plan.types import GIB, Assumptions, Layout, Memory, Plan, StepTime
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel.config import sequence_parallel_on
from megatron_maspo.parallel.logprobs_budget import DEFAULT_BUDGET_BYTES
from megatron_maspo.parallel.pipeline_split import suggestions
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.fleet import FleetLayout, build_fleet

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig

__all__ = ["GIB", "Assumptions", "Layout", "Memory", "Plan", "StepTime", "active_params", "activation_bytes",
           "apply_layout", "arch_of", "dense_attention_bytes", "estimate", "expert_active_params", "fleet_of",
           "format_plan", "cache_bytes_per_sequence", "kv_bytes_per_token", "layout_of", "local_params", "suggest"]

logger = logging.getLogger(__name__)

FP8_TRAINING_KEYS = ("model.fp8", "model.fp8_training", "train.fp8")
"""Where a config would ask for FP8 training (Megatron's TransformerConfig names it ``fp8``). The config
schema has no such key today (``--set model.fp8=...`` is refused as an unknown key before the planner runs),
so only a config object that carries one (built in code, or by a newer schema) reaches the note."""
FP8_TRAINING_NOTE = "FP8 training is not modelled; estimated as bf16"


def fp8_training_requested(cfg: MaspoConfig) -> bool:
    """Whether any of ``FP8_TRAINING_KEYS`` is set (truthy) on ``cfg``."""
    sections = (key.split(".") for key in FP8_TRAINING_KEYS)
    return any(getattr(getattr(cfg, section, None), name, None) for section, name in sections)


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
                  distributed_optimizer=p.distributed_optimizer, vllm_tp=cfg.rollout.vllm_tp, cp=p.cp,
                  pp_first=p.pp_first_layers, pp_last=p.pp_last_layers)


def fleet_of(cfg: MaspoConfig, lay: Layout, world: int) -> FleetLayout | None:
    """The :class:`FleetLayout` the trainer would build for ``cfg`` with layout ``lay`` on ``world`` GPUs."""
    try:  # the config's own validation refuses layouts that do not divide the world: no fleet then
        p = dataclasses.replace(cfg.parallel, tp=lay.tp, pp=lay.pp, ep=lay.ep, pp_first_layers=lay.pp_first,
                                pp_last_layers=lay.pp_last)
        cfg = dataclasses.replace(cfg, parallel=p, rollout=dataclasses.replace(cfg.rollout, vllm_tp=lay.vllm_tp))
        return build_fleet(cfg.parallel, cfg.rollout, world)
    except ValueError:
        return None  # refused elsewhere (vllm_tp or tp*pp does not divide the world)


def _cp_ring(spec: ArchSpec, lay: Layout, row: int, seq: float, elt: int, hw: Assumptions,
             gpus_per_node: int) -> tuple[float, float]:
    """Exposed ring-attention seconds (forward, backward) per layer and micro-batch (launch/plan/cp.py)."""
    load = RingLoad(cp=lay.cp, row_tokens=row, seq_mean=min(seq, row), heads=spec.num_attention_heads,
                    kv_groups=spec.num_query_groups, head_dim=spec.kv_channels, tp=lay.tp, elt=elt)
    bw = ring_link_gb_s(lay.tp, lay.cp, gpus_per_node, intra_gb_s=hw.nvlink_gb_s, inter_gb_s=hw.internode_gb_s)
    return ring_exposed_seconds(load, link_gb_s=bw, latency_s=hw.p2p_latency_us * 1e-6,
                                flops_per_s=hw.peak_tflops * 1e12 * hw.mfu)


def _layout_reasons(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, world: int,
                    gpus_per_node: int) -> tuple[list[str], int]:
    """Constraints the layout violates on ``world`` GPUs, and its data-parallel size (0: does not divide)."""
    reasons: list[str] = []
    try:
        spec.validate_layout(lay.tp, lay.pp, lay.ep, lay.vpp,
                             sequence_parallel=sequence_parallel_on(cfg.parallel.sequence_parallel,
                                                                    cfg.model.attention_backend, lay.tp,
                                                                    spec.is_moe),
                             pp_first=lay.pp_first, pp_last=lay.pp_last)
    except ValueError as e:
        reasons.append(str(e))
    if spec.is_moe:
        from megatron_maspo.model.moe import moe_plan_reasons

        reasons += moe_plan_reasons(cfg.model, cfg.rollout, spec, lay.ep)
    if world % (lay.tp * lay.pp * lay.cp):
        what = "tp*pp" if lay.cp == 1 else "tp*pp*cp"
        reasons.append(f"world size {world} is not divisible by {what} = {lay.tp * lay.pp * lay.cp}")
        return reasons, 0
    dp = world // (lay.tp * lay.pp * lay.cp)
    if lay.cp > 1:  # the trainer's own check: what CP cannot split (dense mask, sequence-level losses)
        reasons += cp_trainer_reasons(cfg, lay.tp, lay.pp, lay.cp, world)
    if lay.tp > gpus_per_node:
        reasons.append(f"tp={lay.tp} spans nodes (gpus_per_node={gpus_per_node}); keep TP inside NVLink")
    if (dp * lay.cp * lay.tp) % lay.ep:  # experts at expert-TP 1 lie over TP x CP x DP (parallel/groups.py)
        reasons.append(f"tp*cp*dp = {lay.tp * lay.cp * dp} is not divisible by ep={lay.ep}")
    return reasons, dp


def _engine_tp_reasons(lay: Layout, engine_gpus: int, gpus_per_node: int) -> list[str]:
    """The engine TP must divide the GPUs the engines run on (the world colocated, the rollout pool
    disaggregated): inside a node it divides the node's GPUs, beyond one it takes whole nodes
    (``rollout/fleet.py::place_engine``)."""
    t, g = lay.vllm_tp, gpus_per_node
    if engine_gpus % t:
        return [f"rollout.vllm_tp={t} must divide the engines' GPUs ({engine_gpus})"]
    if (t <= g and g % t) or (t > g and t % g):
        return [f"rollout.vllm_tp={t} must divide the {g} GPUs of a node, or be a multiple of them (an engine "
                "larger than a node takes whole nodes)"]
    return []


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """Lengths and batch shapes one estimate derives from the config and :class:`Assumptions`."""

    seq_max: int
    """Longest prompt + response budget, tokens."""
    avg_prompt: float
    avg_resp: float
    tail: float
    n_seqs: int
    """Sequences per step."""
    n_micro: int
    """Micro-batches per rank per mini-batch."""
    inflight: float
    """Micro-batches in flight on pipeline stage 0 (interleaving included)."""
    n_tok: int
    """Tokens of one micro-batch row on this GPU (context parallelism splits a row)."""
    elt: int
    has_ref: bool

    @property
    def avg_seq(self) -> float:
        return self.avg_prompt + self.avg_resp


def _shape(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, dp: int, hw: Assumptions,
           reasons: list[str]) -> _Shape:
    """The step's lengths and micro-batching; appends to ``reasons`` the length constraints violated."""
    tr, ro = cfg.train, cfg.rollout
    # Longer prompts are skipped by the data loader (data.*) or truncated (train.*): the smaller bounds.
    max_prompt = cfg.data.max_prompt_tokens
    seq_max = max_prompt + ro.max_new_tokens
    row = tr.max_tokens_per_micro_batch * lay.cp  # the budget counts tokens per CP rank (as the trainer)
    if seq_max > row:
        per_rank = "" if lay.cp == 1 else f" x cp {lay.cp}"
        reasons.append(f"train.max_tokens_per_micro_batch={tr.max_tokens_per_micro_batch}{per_rank} < max prompt + "
                       f"rollout.max_new_tokens = {seq_max}: a full-length sequence fits no micro-batch")
    if seq_max > spec.max_position_embeddings:
        reasons.append(f"sequence length {seq_max} exceeds max_position_embeddings={spec.max_position_embeddings}")
    seqs_per_mini = tr.prompts_per_step // tr.mini_batches_per_step * ro.group_size
    if seqs_per_mini < dp:
        reasons.append(f"{seqs_per_mini} sequences per mini-batch < dp={dp}: some ranks would get none")
    avg_prompt = hw.prompt_mean if hw.prompt_mean is not None else max_prompt * hw.prompt_frac
    avg_resp = hw.response_mean if hw.response_mean is not None else ro.max_new_tokens * hw.response_frac
    tail = min(ro.max_new_tokens, hw.response_max if hw.response_max is not None else ro.max_new_tokens)
    if avg_resp > tail:
        reasons.append(f"mean response {avg_resp:.0f} tokens > longest response {tail:.0f}")
    tokens_per_rank_mini = seqs_per_mini * (avg_prompt + avg_resp) / dp
    n_micro = max(1, math.ceil(tokens_per_rank_mini / row))
    inflight: float = min(lay.pp, n_micro)
    if lay.vpp:
        inflight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return _Shape(seq_max=seq_max, avg_prompt=avg_prompt, avg_resp=avg_resp, tail=tail,
                  n_seqs=tr.prompts_per_step * ro.group_size, n_micro=n_micro, inflight=inflight,
                  n_tok=row // lay.cp,  # this GPU's share of a row under context parallelism
                  # fp16 weights: 2 bytes too; FP8 training is estimated as bf16 (FP8_TRAINING_NOTE)
                  elt=2 if (cfg.model.bf16 or cfg.model.fp16 or fp8_training_requested(cfg)) else 4,
                  has_ref=tr.reference_model or cfg.loss.kl_coef > 0)  # the actor builds one in either case


def _engine_bytes(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, sh: _Shape, world: int,
                  hw: Assumptions) -> tuple[float, float, float]:
    """(engine share, its weights, its KV pool) in bytes per GPU."""
    ro, tr = cfg.rollout, cfg.train
    engine_w = engine_weight_bytes(spec, lay.vllm_tp, ro.vllm_quantization)
    if engines.reserves_gpu_share(ro):
        engine = ro.vllm_gpu_memory_utilization * hw.gpu_mem_gb * GIB
        kv_pool = engine - engine_w - hw.engine_overhead_gb * GIB
    else:  # builtin engine: a bf16 copy plus KV for this rank's sequences at full length
        kv_pool = ro.group_size * tr.prompts_per_step / world * cache_bytes_per_sequence(spec, 1, sh.seq_max)
        engine = engine_w + kv_pool
    return engine, engine_w, kv_pool


def _memory(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, dp: int, sh: _Shape, engine: float,
            engine_w: float, hw: Assumptions) -> tuple[Memory, dict[str, float]]:
    """Per-GPU memory and the bytes per offload category moved to the host during generation."""
    tr = cfg.train
    p_dense, p_expert = local_params(spec, lay, cfg.model.make_vocab_size_divisible_by)
    p_local, elt, n_tok = p_dense + p_expert, sh.elt, sh.n_tok
    opt_per_param = 12 if elt == 2 else 8  # 16-bit weights + fp32 master copy (memory.py: sources)
    d_dense = dp * lay.cp if lay.distributed_optimizer else 1  # Megatron shards over the dp x cp group
    # expert data-parallel size = tp*cp*dp/ep: Megatron's expert layout is ETP 1 x EP x expert-DP x PP
    d_expert = max(1, dp * lay.cp * lay.tp // lay.ep) if lay.distributed_optimizer else 1
    backend = cfg.model.attention_backend
    sp = sequence_parallel_on(cfg.parallel.sequence_parallel, backend, lay.tp, spec.is_moe)
    per_layer = activation_bytes(spec, lay.tp, lay.recompute, elt, sp)
    act = sh.inflight * lay.stage_layer_count(spec.num_layers) * n_tok * per_layer
    if lay.recompute == "full":
        act += n_tok * activation_bytes(spec, lay.tp, None, elt, sp)
    act += n_tok * spec.hidden_size * elt / (lay.tp if sp else 1)  # final hidden states for the LM head
    attn = dense_attention_bytes(spec, lay, n_tok, sh.inflight, elt) if backend == "dense_mask" else 0.0
    v_pad = spec.padded_vocab_size(lay.tp, cfg.model.make_vocab_size_divisible_by)
    budget = tr.logprob_chunk_bytes or DEFAULT_BUDGET_BYTES["cuda"]
    logprob = min(budget, n_tok * v_pad / lay.tp * (elt + 8))
    state = category_bytes(weights=p_local * elt, reference=p_local * elt if sh.has_ref else 0.0,
                           grads=p_local * 4, optimizer=(p_dense / d_dense + p_expert / d_expert) * opt_per_param)
    off = offloaded_bytes(state, params=tr.offload_params, grads=tr.offload_grads,
                          optimizer=tr.offload_optimizer)
    mem = Memory(weights=p_local * elt / GIB, grads=state["grads"] / GIB, optimizer=state["optimizer"] / GIB,
                 activations=act / GIB, logprob=logprob / GIB, engine=engine / GIB,
                 reserve=hw.reserve_gb, attention=attn / GIB, attention_backend=backend,
                 reference=(state["params"] - p_local * elt) / GIB,
                 offloaded={c: b / GIB for c, b in off.items() if b}, engine_weights=engine_w / GIB,
                 sync_bucket=sync_buckets(cfg.rollout) * cfg.rollout.bucket_mb / 1024)
    return mem, off


def sync_buckets(ro) -> int:
    """Buckets a colocated sync holds on one GPU at once: an engine in its own processes (vLLM) double-buffers on the
    trainer's side (``rollout/transport.py::BucketPool``, two buffers) and its worker copies the bucket it
    loads (``take_bucket``: its layer-wise reload keeps references); the in-process built-in engine loads
    from the one bucket being packed."""
    return 3 if engines.relays_to_workers(ro) and ro.weight_transport == "ipc" else 1


def _memory_reasons(mem: Memory, sh: _Shape, kv_pool: float, kv_seqs: int, hw: Assumptions) -> list[str]:
    """Why the memory does not fit (empty when it does)."""
    reasons = []
    if mem.peak > hw.gpu_mem_gb:
        why = (f"; model.attention_backend='dense_mask' holds {mem.attention:.1f} GiB of [S, S] attention "
               f"tensors at S={sh.n_tok}: 'packed_sdpa' or 'te' are linear in S" if mem.attention else "")
        reasons.append(f"needs {mem.peak:.1f} GiB per GPU > {hw.gpu_mem_gb:.0f} GiB (train peak "
                       f"{mem.train_peak:.1f}, rollout peak {mem.rollout_peak:.1f}){why}")
    if kv_seqs < 1:
        reasons.append(f"the engine's KV pool ({kv_pool / GIB:.1f} GiB) holds no full-length sequence of "
                       f"{sh.seq_max} tokens; raise rollout.vllm_gpu_memory_utilization or vllm_tp")
    return reasons


def seq_second_moment(sh: _Shape) -> float:
    """E[(p + L)^2] of the step's sequence lengths (tokens^2): prompts at their mean p, responses L with the
    mean and tail of ``sh`` spread by the maximum-entropy law of ``rollout.length_second_moment``.

    A causal attention pass costs ~ sum_i s_i^2, so with responses spread between 0 and the tail it costs
    n E[s^2], up to 4/3 (uniform) or 2 (mean far below the tail) times n (E s)^2 on the response part.
    """
    p, m = sh.avg_prompt, sh.avg_resp
    return p * p + 2 * p * m + length_second_moment(m, sh.tail)


def _trainer_seconds(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, sh: _Shape, world: int, hw: Assumptions,
                     gpus_per_node: int) -> tuple[float, float]:
    """(old-logprob, update) seconds per step: FLOPs at the MFUs, CP ring, MoE all-to-all and controller
    dispatch added."""
    tr = cfg.train
    n_seqs, avg_seq = sh.n_seqs, sh.avg_seq
    f_fwd = 2 * active_params(spec) * n_seqs * avg_seq
    if cfg.model.attention_backend == "dense_mask":  # the [S, S] scores cover the whole packed row
        f_fwd += 4 * spec.num_layers * spec.num_attention_heads * spec.kv_channels * sh.n_tok * n_seqs * avg_seq
    else:  # causal scores sum s^2 over the sequences: the spread of the lengths, not the mean's square
        f_fwd += 2 * spec.num_layers * spec.num_attention_heads * spec.kv_channels * seq_second_moment(sh) * n_seqs
    f_exp = 2 * expert_active_params(spec) * n_seqs * avg_seq
    peak = world * hw.peak_tflops * 1e12
    mfu = gemm_mfu(hw.mfu, spec.hidden_size, lay.tp, sh.n_tok, ref_width=hw.mfu_ref_width,
                   ref_tokens=hw.mfu_ref_tokens)
    # 1F1B pipeline bubble: (pp - 1) / (micro-batches x virtual stages) of each pass idles (Narayanan 2021)
    bubble = 1 + (lay.pp - 1) / (sh.n_micro * (lay.vpp or 1))
    fwd_s = ((f_fwd - f_exp) / (peak * mfu) + f_exp / (peak * hw.moe_expert_mfu)) * bubble
    ring_f, ring_b = _cp_ring(spec, lay, tr.max_tokens_per_micro_batch * lay.cp, avg_seq, sh.elt, hw,
                              gpus_per_node)
    busiest = lay.stage_layer_count(spec.num_layers)  # the pipeline runs at its busiest stage's pace
    ring_fwd = ring_f * sh.n_micro * tr.mini_batches_per_step * busiest
    ring_bwd = ring_b * sh.n_micro * tr.mini_batches_per_step * busiest
    # MoE token all-to-all over EP (launch/plan/moe_comm.py): the step's tokens per data-parallel replica
    a2a_f, a2a_b = a2a_seconds(spec, lay, n_seqs * avg_seq / (world // (lay.tp * lay.pp * lay.cp)), sh.elt, hw,
                               gpus_per_node, micro_batches=sh.n_micro * tr.mini_batches_per_step)
    ring_fwd, ring_bwd = ring_fwd + a2a_f, ring_bwd + a2a_b
    old_lp = (fwd_s + ring_fwd) * (2 if sh.has_ref else 1)
    update = fwd_s * (4 if lay.recompute == "full" else 3) + ring_fwd * (2 if lay.recompute == "full" else 1) \
        + ring_bwd
    if hw.controller_gb_s:  # the batch, padded to its longest sequence, shipped to every tp*pp*cp rank
        # imported here: dispatch also runs as a script (python -m), which the package must not import first
        from megatron_maspo.launch.plan.dispatch import step_dispatch_seconds

        lp_d, up_d = step_dispatch_seconds(seqs=n_seqs, padded_len=min(sh.seq_max, sh.avg_prompt + sh.tail),
                                           replicas=lay.tp * lay.pp * lay.cp, reference=sh.has_ref,
                                           controller_gb_s=hw.controller_gb_s)
        old_lp, update = old_lp + lp_d, update + up_d
    return old_lp, update


def _generation(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, sh: _Shape, fleet: FleetLayout | None,
                engine_w: float, kv_pool: float, hw: Assumptions, gpus_per_node: int) -> float:
    """Seconds of the rollout phase on the most loaded engine (launch/plan/rollout.py); with
    ``rollout.in_flight_updates`` (disaggregated) the straggler tail overlaps the next batch."""
    ro, tr = cfg.rollout, cfg.train
    kvpt = kv_bytes_per_token(spec, lay.vllm_tp)
    per_engine = max(fleet.shard_sizes(tr.prompts_per_step)) * ro.group_size if fleet else sh.n_seqs
    live = sh.avg_prompt + sh.avg_resp / 2
    conc = max(1, min(per_engine, int(max(0.0, kv_pool) // cache_bytes_per_sequence(spec, lay.vllm_tp, live))))
    w_full = w_tail = engine_w
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        e, k = spec.num_moe_experts, spec.moe_router_topk
        w_exp = engine_expert_bytes(spec, lay.vllm_tp, ro.vllm_quantization)  # MoE layers only
        w_full = engine_w - w_exp * (1 - moe_touched_fraction(conc, e, k))
        w_tail = engine_w - w_exp * (1 - moe_touched_fraction(1, e, k))
    comm_step, comm_token = cross_node_allreduce(hidden=spec.hidden_size, layers=spec.num_layers,
                                                 vllm_tp=lay.vllm_tp, gpus_per_node=gpus_per_node,
                                                 latency_us=hw.p2p_latency_us, internode_gb_s=hw.internode_gb_s)
    load = EngineLoad(seqs=per_engine, conc=conc, prompt=sh.avg_prompt, mean=sh.avg_resp, tail=sh.tail,
                      weight_bytes_full=w_full, weight_bytes_tail=w_tail, kv_token_bytes=kvpt,
                      active_params=active_params(spec), vllm_tp=lay.vllm_tp, comm_step_s=comm_step,
                      comm_token_s=comm_token)
    # FP8 W8A8 GEMMs run at twice the bf16 tensor peak on Hopper (H100/H200 SXM datasheet: 1,979 vs 989
    # dense TFLOP/s); the planner applies that to the engine's prefill and compute bound only
    peak = hw.peak_tflops * (2 if ro.vllm_quantization == "fp8" else 1)
    return generation_seconds(load, hbm_tb_s=hw.hbm_tb_s, decode_eff=hw.decode_bw_eff,
                              peak_tflops=peak, mfu=hw.mfu, step_fixed_s=hw.decode_step_ms * 1e-3,
                              tail_overlapped=ro.disaggregated and ro.in_flight_updates)


def _grading_seconds(cfg: MaspoConfig, fleet: FleetLayout | None, n_seqs: int, hw: Assumptions) -> float:
    """math-verify on the most loaded engine rank: its responses over its reward workers (each engine
    rank grades what it generated, train/loop.py), after generation and before the log-prob pass."""
    per_engine = max(fleet.shard_sizes(cfg.train.prompts_per_step)) * cfg.rollout.group_size if fleet else n_seqs
    return per_engine / (cfg.reward.num_workers * hw.grade_items_per_s)


def estimate(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, *, nodes: int, gpus_per_node: int,
             hw: Assumptions | None = None) -> Plan:
    """Memory and time for ``cfg`` on ``nodes x gpus_per_node`` GPUs with layout ``lay``.

    Returns a :class:`Plan`; ``plan.reasons`` lists every violated constraint (empty when it fits).
    """
    hw = hw or Assumptions()
    world = nodes * gpus_per_node
    notes = [FP8_TRAINING_NOTE] if fp8_training_requested(cfg) else []
    reasons, dp = _layout_reasons(cfg, spec, lay, world, gpus_per_node)
    if not dp:
        return Plan(layout=lay, world=world, dp=0, reasons=reasons, notes=notes)
    reasons += _engine_tp_reasons(lay, world, gpus_per_node)
    sh = _shape(cfg, spec, lay, dp, hw, reasons)
    engine, engine_w, kv_pool = _engine_bytes(cfg, spec, lay, sh, world, hw)
    mem, off = _memory(cfg, spec, lay, dp, sh, engine, engine_w, hw)
    kv_seqs = int(max(0.0, kv_pool) // cache_bytes_per_sequence(spec, lay.vllm_tp, sh.seq_max))
    reasons += _memory_reasons(mem, sh, kv_pool, kv_seqs, hw)
    old_lp, update = _trainer_seconds(cfg, spec, lay, sh, world, hw, gpus_per_node)
    fleet = fleet_of(cfg, lay, world)  # the layout the trainer builds (rollout/fleet.py)
    gen = _generation(cfg, spec, lay, sh, fleet, engine_w, kv_pool, hw, gpus_per_node)
    w_bytes = 2 * spec.num_parameters()
    sync = hw.sync_fixed_s + w_bytes / (hw.sync_gb_s * 1e9) + cross_node_relay_seconds(
        w_bytes, vllm_tp=lay.vllm_tp, gpus_per_node=gpus_per_node, internode_gb_s=hw.internode_gb_s)
    ro = cfg.rollout
    return Plan(layout=lay, world=world, dp=dp, memory=mem, kv_seqs=kv_seqs, reasons=reasons, notes=notes,
                engines=fleet.num_engines if fleet else 1, tail=sh.tail, fleet=fleet,
                prompts_per_step=cfg.train.prompts_per_step,
                transport=ro.weight_transport if engines.relays_to_workers(ro) else "in-process", bucket_mb=ro.bucket_mb,
                gpus_per_node=gpus_per_node,
                time=StepTime(generation=gen, old_logprob=old_lp, update=update, sync=sync,
                              offload=2 * sum(off.values()) / (hw.host_gb_s * 1e9),
                              grading=_grading_seconds(cfg, fleet, sh.n_seqs, hw)))


def _divisors(n: int, cap: int) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0]


def suggest(cfg: MaspoConfig, spec: ArchSpec, *, nodes: int, gpus_per_node: int,
            hw: Assumptions | None = None) -> Plan | None:
    """The fitting layout nearest to the config's: fewest changed knobs, then the fastest step."""
    base = layout_of(cfg)
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    # engines may also take 2 or 4 whole nodes (their weights leave no KV cache inside one)
    vtps = tps + [gpus_per_node * k for k in (2, 4) if gpus_per_node * k <= nodes * gpus_per_node]
    # even splits, and the most balanced uneven one where pp does not divide the layers (61 at PP 16)
    pps = [(pp, None, None) for pp in _divisors(spec.num_layers, 16)]
    pps += [(pp, *best[0]) for pp in (2, 4, 8, 16)
            if spec.num_layers % pp and pp < spec.num_layers and (best := suggestions(spec.num_layers, pp))]
    eps = [e for e in _divisors(spec.num_moe_experts, 256) if e & (e - 1) == 0] if spec.is_moe else [1]
    best: tuple[tuple[int, float], Plan] | None = None
    for tp, (pp, first, last), ep, rc, do, vtp in itertools.product(tps, pps, eps, (None, "selective", "full"),
                                                                    (False, True), vtps):
        if (pp, first, last) == (base.pp, None, None) and (base.pp_first, base.pp_last) != (None, None):
            first, last = base.pp_first, base.pp_last  # the config's own uneven split at its pp
        lay = Layout(tp=tp, pp=pp, ep=ep, vpp=base.vpp if base.vpp and pp == base.pp else None,
                     recompute=rc, distributed_optimizer=do, vllm_tp=vtp, pp_first=first, pp_last=last)
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
             "vllm_tp": "rollout.vllm_tp", "cp": "parallel.cp", "pp_first": "parallel.pp_first_layers",
             "pp_last": "parallel.pp_last_layers"}
    out = []
    for f in dataclasses.fields(Layout):
        new = getattr(lay, f.name)
        if new != getattr(cur, f.name):
            out.append(f"{names[f.name]}={'null' if new is None else str(new).lower()}")
    return out
