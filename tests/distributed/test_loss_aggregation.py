"""Exact aggregation (loss-formulas.md §2.2): 2 DP ranks x {1, 3} uneven micro-batches give the single-batch
loss, gradient and metrics, for every aggregation mode, through both the plain-autograd form and the
Megatron ``calculate_per_token_loss`` 3-tuple form; BAPO's bounds agree across the DP all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_maspo.loss import (
    LossConfig,
    LossInputs,
    compute_policy_loss,
    local_units,
    megatron_loss_tuple,
)
from megatron_maspo.loss.metrics import accumulate_metrics, reduce_metrics
from tests.distributed._launch import run_workers

F64 = torch.float64
N_SEQ = 10
RANK_SEQS = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]                       # unequal DP shards
MICRO = {0: [[0], [1, 2], [3]], 1: [[4, 5, 6, 7], [8], [9]]}         # unequal micro-batches
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _global_batch():
    g = torch.Generator().manual_seed(123)
    lens = torch.randint(2, 12, (N_SEQ,), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(N_SEQ), lens)
    t = int(lens.sum())
    old = -torch.rand(t, generator=g, dtype=F64) * 4 - 0.01
    logp = old + 0.7 * torch.randn(t, generator=g, dtype=F64)
    adv = torch.randn(N_SEQ, generator=g, dtype=F64)[seq_ids]
    mask = torch.rand(t, generator=g) > 0.2
    ent = torch.rand(t, generator=g, dtype=F64)
    return logp, old, adv, mask, seq_ids, ent


def _cfg(mode: str, method: str = "maspo") -> LossConfig:
    return LossConfig(method=method, aggregation=mode, norm_constant=12.0, entropy_coef=0.01)


def _run(seqs_per_micro, mode, method, dp_group, n_glob, s_glob, megatron):
    """Loss and gradient w.r.t. the global logprobs from this rank's micro-batches."""
    logp, old, adv, mask, seq_ids, ent = _global_batch()
    leaf = logp.clone().requires_grad_()
    total, metrics, count = torch.zeros((), dtype=F64), {}, 0
    for seqs in seqs_per_micro:
        sel = torch.isin(seq_ids, torch.tensor(seqs))
        loss, met = compute_policy_loss(_cfg(mode, method), LossInputs(
            logprobs=leaf[sel], old_logprobs=old[sel], advantages=adv[sel], mask=mask[sel],
            num_tokens_global=n_glob, num_seqs_global=s_glob, seq_ids=seq_ids[sel],
            entropy=ent[sel]), dp_group=dp_group)
        if megatron:
            units_tok = mode in ("token-mean", "seq-mean-token-sum-norm")
            n_units = local_units("token-mean" if units_tok else mode, mask[sel], seq_ids[sel])
            num, cnt, _ = megatron_loss_tuple(loss, num_local_units=n_units,
                                              num_global_units=n_glob if units_tok else s_glob)
            num.backward()          # schedule: no division; DDP: sum
            count += int(cnt)
            total = total + num.detach()
        else:
            loss.backward()
            total = total + loss.detach()
        metrics = accumulate_metrics(metrics, met)
    grad = leaf.grad.clone()
    if dp_group is not None:
        dist.all_reduce(grad, group=dp_group)
        dist.all_reduce(total, group=dp_group)
        c = torch.tensor(count)
        dist.all_reduce(c, group=dp_group)
        count = int(c)
    if megatron:  # finalize_model_grads: divide by the DP-summed count
        grad, total = grad / count, total / count
    return total, grad, reduce_metrics(metrics, dp_group)


def _counts(seqs):
    _, _, _, mask, seq_ids, _ = _global_batch()
    sel = torch.isin(seq_ids, torch.tensor(seqs))
    return int(mask[sel].sum()), int(torch.unique(seq_ids[sel & mask]).numel())


def _worker(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    # Count first: one SUM all-reduce of (tokens, responses) before any forward.
    counts = torch.tensor(_counts(RANK_SEQS[rank]), dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    n_glob, s_glob = int(counts[0]), int(counts[1])
    out = {}
    for mode in MODES:
        for n_micro in (1, 3):
            micro = MICRO[rank] if n_micro == 3 else [RANK_SEQS[rank]]
            for megatron in (False, True):
                out[(mode, n_micro, megatron)] = _run(micro, mode, "maspo", group, n_glob, s_glob, megatron)
    out["bapo"] = _run([RANK_SEQS[rank]], "token-mean", "bapo", group, n_glob, s_glob, False)
    return out


def test_two_dp_ranks_three_microbatches_match_single_batch():
    n_glob, s_glob = _counts(list(range(N_SEQ)))
    results = run_workers(_worker, 2, timeout_s=120)
    for key in [k for k in results[0] if k != "bapo"]:
        mode = key[0]
        ref_loss, ref_grad, ref_met = _run([list(range(N_SEQ))], mode, "maspo", None, n_glob, s_glob, False)
        assert ref_grad.abs().sum() > 0
        for rank in (0, 1):
            loss, grad, met = results[rank][key]
            rel = (grad - ref_grad).abs().max() / ref_grad.abs().max()
            assert rel <= 1e-10, (key, rank, float(rel))
            assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (key, rank)
            assert set(met) == set(ref_met)
            for k, v in met.items():
                torch.testing.assert_close(v, ref_met[k], rtol=1e-10, atol=1e-12, msg=f"{key} {k}")
    # D = 1, M = 3 in-process (the same micro-batch accumulation without DP).
    micro = MICRO[0] + MICRO[1]
    for mode in MODES:
        loss, grad, _ = _run(micro, mode, "maspo", None, n_glob, s_glob, False)
        ref_loss, ref_grad, _ = _run([list(range(N_SEQ))], mode, "maspo", None, n_glob, s_glob, False)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    # BAPO: bounds searched on DP-reduced sums equal the single-process search.
    ref_loss, ref_grad, ref_met = _run([list(range(N_SEQ))], "token-mean", "bapo", None, n_glob, s_glob, False)
    for rank in (0, 1):
        loss, grad, met = results[rank]["bapo"]
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
        for k in ("bapo/c_low", "bapo/c_high", "bapo/pos_share"):
            torch.testing.assert_close(met[k], ref_met[k], rtol=1e-10, atol=1e-12)
