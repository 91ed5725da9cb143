"""GSPO is exact under micro-batching and DP (issue 34): the loss and gradient of 1 vs 4 micro-batches
and of DP 1 vs 2 (gloo, 2 processes) agree to 1e-12 in float64, with and without the 'seq_mask'
rollout correction (both sequence statistics). A response's tokens stay in one micro-batch, as
`train/actor/packing.py` guarantees; the global counts are reduced once before the first forward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_maspo.loss import LossConfig, LossInputs, compute_policy_loss
from megatron_maspo.loss.params import GspoParams, RolloutCorrectionParams
from tests.distributed._launch import run_workers

F64 = torch.float64
N_SEQ = 12
RANK_SEQS = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
MICRO4 = {0: [[0], [1, 2], [3], [4]], 1: [[5, 6, 7], [8], [9, 10], [11]]}


def _global_batch():
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(2, 14, (N_SEQ,), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(N_SEQ), lens)
    t = int(lens.sum())
    old = -torch.rand(t, generator=g, dtype=F64) * 4 - 0.01
    logp = old + 2e-3 * torch.randn(t, generator=g, dtype=F64)
    adv = torch.randn(N_SEQ, generator=g, dtype=F64)[seq_ids]
    rollout = old + 0.05 * torch.randn(t, generator=g, dtype=F64)
    mask = torch.rand(t, generator=g) > 0.1
    return logp, old, adv, rollout, mask, seq_ids


def _cfg(corrected: bool) -> LossConfig:
    rc = RolloutCorrectionParams(mode="seq_mask", lower=0.98, upper=1.02) if corrected else \
        RolloutCorrectionParams()
    return LossConfig(method="gspo", gspo=GspoParams(eps_low=1e-3, eps_high=1.5e-3), rollout_correction=rc)


def _counts(seqs):
    _, _, _, _, mask, seq_ids = _global_batch()
    sel = torch.isin(seq_ids, torch.tensor(seqs))
    return int(mask[sel].sum()), int(torch.unique(seq_ids[sel & mask]).numel())


def _run(micro, corrected, n_glob, s_glob, group=None):
    """Summed loss and the gradient w.r.t. the global log-probs over this process's micro-batches."""
    logp, old, adv, rollout, mask, seq_ids = _global_batch()
    leaf = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for seqs in micro:
        sel = torch.isin(seq_ids, torch.tensor(seqs))
        loss, _ = compute_policy_loss(_cfg(corrected), LossInputs(
            logprobs=leaf[sel], old_logprobs=old[sel], advantages=adv[sel], mask=mask[sel],
            num_tokens_global=n_glob, num_seqs_global=s_glob, seq_ids=seq_ids[sel],
            rollout_logprobs=rollout[sel]))
        loss.backward()
        total = total + loss.detach()
    grad = leaf.grad.clone()
    if group is not None:  # DDP: SUM of gradients and of the per-rank loss shares
        dist.all_reduce(grad, group=group)
        dist.all_reduce(total, group=group)
    return total, grad


def _worker(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    counts = torch.tensor(_counts(RANK_SEQS[rank]), dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    n_glob, s_glob = int(counts[0]), int(counts[1])
    return {(c, m): _run(MICRO4[rank] if m == 4 else [RANK_SEQS[rank]], c, n_glob, s_glob, group)
            for c in (False, True) for m in (1, 4)}


def test_gspo_micro_batches_and_dp_match_single_batch():
    n_glob, s_glob = _counts(list(range(N_SEQ)))
    results = run_workers(_worker, 2, timeout_s=120)
    for corrected in (False, True):
        ref_loss, ref_grad = _run([list(range(N_SEQ))], corrected, n_glob, s_glob)
        assert ref_grad.abs().max() > 0 and (ref_grad[_global_batch()[4]] == 0).any()  # clips bite
        # DP 1, 4 micro-batches
        loss, grad = _run(MICRO4[0] + MICRO4[1], corrected, n_glob, s_glob)
        assert abs(float(loss - ref_loss)) <= 1e-12
        assert float((grad - ref_grad).abs().max()) <= 1e-12
        # DP 2, 1 or 4 micro-batches per rank
        for m in (1, 4):
            for rank in (0, 1):
                loss, grad = results[rank][(corrected, m)]
                assert abs(float(loss - ref_loss)) <= 1e-12, (corrected, m, rank)
                assert float((grad - ref_grad).abs().max()) <= 1e-12, (corrected, m, rank)
