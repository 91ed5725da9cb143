"""Context parallelism: the config accepts parallel.cp, the trainer refuses only what CP cannot split
(one-line errors, shared with the planner), and the planner models what CP splits (rows, optimizer
shards) and what its ring K/V exchange costs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.errors import ConfigError
from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.cp import (
    RingLoad,
    kv_hop_bytes,
    ring_exposed_seconds,
    ring_link_gb_s,
)
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.recipes.registry import load_recipe
from megatron_maspo.train.preflight import check_layout_supported


def test_config_takes_cp_into_the_layout():
    p = ParallelConfig(tp=8, pp=4, cp=4, world_size=128)
    assert p.dp == 1
    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*cp=64"):
        ParallelConfig(tp=8, pp=2, cp=4, world_size=96)
    with pytest.raises(ValueError, match="parallel.cp must be >= 1"):
        ParallelConfig(cp=0)


def test_trainer_refuses_what_cp_cannot_split(capsys):
    cfg = load_recipe("tiny")
    check_layout_supported(cfg.parallel)  # cp = 1: nothing to refuse
    cfg.parallel = dataclasses.replace(cfg.parallel, cp=2, world_size=2)
    check_layout_supported(cfg.parallel, cfg.model, cfg.loss)  # packed_sdpa, token-mean: accepted
    cfg.model.attention_backend = "dense_mask"
    with pytest.raises(ConfigError, match="parallel.cp=2 needs model.attention_backend"):
        check_layout_supported(cfg.parallel, cfg.model, cfg.loss)
    cfg.model.attention_backend = "packed_sdpa"
    cfg.loss = dataclasses.replace(cfg.loss, aggregation="seq-mean-token-mean")
    with pytest.raises(ConfigError, match="loss.aggregation='seq-mean-token-mean' with parallel.cp=2"):
        check_layout_supported(cfg.parallel, cfg.model, cfg.loss)
    # the CLI refuses before building anything: one line, exit 2
    assert main(["train", "--recipe", "tiny", "--set", "parallel.world_size=2", "--set", "parallel.cp=2",
                 "--set", "model.attention_backend=dense_mask"]) == 2
    assert "needs model.attention_backend 'packed_sdpa' or 'te'" in capsys.readouterr().err


def _cfg(cp: int, **model):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    cfg.model.attention_backend = "te"
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.parallel = dataclasses.replace(cfg.parallel, cp=cp)
    return cfg


def test_cp_splits_the_row_and_shards_the_optimizer_over_dp_x_cp():
    """CP 2 on 32 GPUs (TP 2): dp halves, each GPU holds half of every row, the optimizer shards are as
    small as without CP (Megatron shards over the dp x cp group)."""
    one, two = _cfg(1), _cfg(2)
    p1 = estimate(one, arch_of(one), layout_of(one), nodes=4, gpus_per_node=8)
    p2 = estimate(two, arch_of(two), layout_of(two), nodes=4, gpus_per_node=8)
    assert (p1.dp, p2.dp) == (16, 8)
    assert p2.memory.optimizer == pytest.approx(p1.memory.optimizer)
    # the budget counts tokens per CP rank (as the trainer): a CP-2 GPU holds a CP-1 GPU's row share,
    # and with half the budget it holds half of the CP-1 row (same micro-batches in flight)
    half = _cfg(2)
    half.train.max_tokens_per_micro_batch //= 2
    ph = estimate(half, arch_of(half), layout_of(half), nodes=4, gpus_per_node=8)
    assert p2.memory.activations == pytest.approx(p1.memory.activations)
    assert ph.memory.activations < p1.memory.activations
    assert not any("parallel.cp" in r for r in p2.reasons)  # the trainer runs CP now


def test_cp_refuses_the_dense_mask_as_the_trainer_does():
    cfg = _cfg(2, attention_backend="dense_mask")
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
    assert any("needs model.attention_backend 'packed_sdpa' or 'te'" in r for r in plan.reasons)
    ok = _cfg(2, attention_backend="packed_sdpa")
    assert not any("parallel.cp" in r for r in estimate(ok, arch_of(ok), layout_of(ok), nodes=4,
                                                          gpus_per_node=8).reasons)


def test_ring_hop_bytes_and_link_choice():
    """Llama-3.3-70B at TP 8, CP 4, rows of 16,384 tokens: one KV head per TP rank, 4,096 tokens a chunk."""
    r = RingLoad(cp=4, row_tokens=16384, seq_mean=900, heads=64, kv_groups=8, head_dim=128, tp=8, elt=2)
    assert kv_hop_bytes(r) == 4096 * 2 * 1 * 128 * 2
    assert ring_link_gb_s(8, 4, 8, intra_gb_s=150, inter_gb_s=40) == 40  # 32 GPUs per row: across nodes
    assert ring_link_gb_s(2, 4, 8, intra_gb_s=150, inter_gb_s=40) == 150


def test_long_sequences_hide_the_ring_exchange_short_ones_expose_it():
    """Attention per hop grows with the sequence length (quadratic per sequence): a row of one 16k
    sequence hides the K/V transfer, a row of 900-token responses leaves it exposed."""
    kw = dict(cp=4, row_tokens=16384, heads=64, kv_groups=8, head_dim=128, tp=8, elt=2)
    rate, lat = 989e12 * 0.35, 20e-6
    short = ring_exposed_seconds(RingLoad(seq_mean=900, **kw), link_gb_s=40, latency_s=lat, flops_per_s=rate)
    long = ring_exposed_seconds(RingLoad(seq_mean=16384, **kw), link_gb_s=40, latency_s=lat, flops_per_s=rate)
    hop = 4096 * 2 * 128 * 2 / 40e9
    attn = 2 * 64 * 128 * 16384 * 900 / (8 * 16) / rate
    assert short[0] == pytest.approx(3 * (lat + hop - attn))
    assert short[1] == pytest.approx(3 * (lat + 2 * hop - 2 * attn))
    assert long == (0.0, 0.0)
    assert ring_exposed_seconds(RingLoad(seq_mean=900, **{**kw, "cp": 1}), link_gb_s=40, latency_s=lat,
                                flops_per_s=rate) == (0.0, 0.0)


def test_cp_adds_its_exposed_ring_time_to_the_forward_phases():
    one, two = _cfg(1), _cfg(2)
    hw = Assumptions(response_mean=600)
    p1 = estimate(one, arch_of(one), layout_of(one), nodes=4, gpus_per_node=8, hw=hw)
    p2 = estimate(two, arch_of(two), layout_of(two), nodes=4, gpus_per_node=8, hw=hw)
    assert p2.time.old_logprob > p1.time.old_logprob and p2.time.update > p1.time.update
    assert p2.time.generation == p1.time.generation  # CP is a trainer layout: rollout unchanged
    free = Assumptions(response_mean=600, p2p_latency_us=0.0, nvlink_gb_s=1e9, internode_gb_s=1e9)
    p2_free = estimate(two, arch_of(two), layout_of(two), nodes=4, gpus_per_node=8, hw=free)
    assert p2_free.time.update == pytest.approx(p1.time.update)  # a free ring costs nothing: same FLOPs


def test_cli_plans_a_cp_layout_the_trainer_runs(capsys):
    rc = main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", "--set", "parallel.cp=2",
               "--set", "model.attention_backend=te"])
    out = capsys.readouterr().out
    assert "tp=2 pp=1 cp=2" in out and "the trainer refuses context parallelism" not in out
    assert rc in (0, 1)  # 1 only for a reason other than CP (memory, time)
    assert "REFUSED: parallel.cp" not in out
