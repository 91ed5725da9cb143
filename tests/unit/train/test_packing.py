"""Packing: budgets, balance across DP, equal micro-batch counts, masks, truncation counters."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.train.actor.packing import (
    assign_micro_batches,
    block_causal_mask,
    build_micro_batch,
    cu_seqlens,
    plan_mini_batch,
    shard_for_dp,
    split_mini_batches,
    trim_lengths,
)
from megatron_maspo.train.actor.samples import Sample


def _samples(lens: list[tuple[int, int]]) -> list[Sample]:
    return [Sample(prompt_ids=list(range(1, p + 1)), response_ids=list(range(100, 100 + r)),
                   advantage=1.0, prompt_index=i // 2) for i, (p, r) in enumerate(lens)]


def test_trim_counts_truncation_and_empty():
    s = _samples([(3, 4), (3, 20), (10, 2), (2, 0)])
    lens, st = trim_lengths(s, 10)
    assert lens == [4, 7, 0, 0]
    assert (st.truncated, st.truncated_tokens, st.empty) == (2, 13 + 2, 2)


def test_micro_batch_layout_and_positions():
    s = _samples([(3, 2), (2, 3)])
    mb = build_micro_batch(s, [0, 1], [2, 3])
    assert mb.tokens.tolist() == [1, 2, 3, 100, 101, 1, 2, 100, 101, 102]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    # hidden at t predicts token t+1: response tokens of seq 0 at 3,4 -> read at 2,3
    assert mb.resp_index.tolist() == [2, 3, 6, 7, 8]
    assert mb.labels.tolist() == [100, 101, 100, 101, 102]
    assert torch.equal(mb.tokens[mb.resp_index + 1], mb.labels)
    assert mb.seq_ids.tolist() == [0, 0, 1, 1, 1] and mb.num_tokens == 5


def test_block_causal_mask_matches_definition():
    m = block_causal_mask([2, 3])[0, 0]
    allowed = ~m
    ids = [0, 0, 1, 1, 1]
    for q in range(5):
        for k in range(5):
            assert bool(allowed[q, k]) == (ids[q] == ids[k] and k <= q)


def test_split_keeps_groups_and_dp_balance():
    s = _samples([(3, 5)] * 8)  # 4 prompts x 2
    minis = split_mini_batches(s, 2)
    assert minis == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="mini_batches_per_step"):
        split_mini_batches(s, 5)
    shards = shard_for_dp([0, 1, 2, 3], [9, 7, 5, 3], 2)
    assert shards == [[0, 3], [1, 2]]  # loads 12 and 12


def test_equal_micro_batch_count_within_budget():
    bins = assign_micro_batches([[(0, 10), (1, 10), (2, 10)], [(3, 4)]], budget=16)
    assert len(bins[0]) == len(bins[1]) == 3
    assert sorted(len(b) for b in bins[1]) == [0, 0, 1]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        assign_micro_batches([[(0, 17)]], budget=16)


def test_plan_is_a_partition_and_counts_globally():
    s = _samples([(3, 5), (4, 2), (2, 9), (5, 1), (3, 3), (2, 6)])
    lens, _ = trim_lengths(s, 12)
    plans = [plan_mini_batch(s, list(range(6)), lens, dp=2, dp_rank=r, budget=12) for r in (0, 1)]
    seen = [i for p in plans for mb in p.micro_batches for i in mb.sample_index]
    assert sorted(seen) == list(range(6))
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches)
    assert all(mb.tokens.numel() <= 12 for p in plans for mb in p.micro_batches)
    assert plans[0].num_tokens_global == sum(lens) == plans[1].num_tokens_global
    assert plans[0].num_seqs_global == 6


def test_equal_rows_pad_every_dp_rank_to_the_longest_row():
    s = _samples([(3, 5), (4, 2), (2, 9), (5, 1), (3, 3), (2, 6)])
    lens, _ = trim_lengths(s, 12)
    kw = dict(dp=2, budget=12)
    plain = [plan_mini_batch(s, list(range(6)), lens, dp_rank=r, **kw) for r in (0, 1)]
    padded = [plan_mini_batch(s, list(range(6)), lens, dp_rank=r, equal_rows=True, **kw)
              for r in (0, 1)]
    for k in range(len(plain[0].micro_batches)):
        want = max(p.micro_batches[k].tokens.numel() for p in plain)
        assert {p.micro_batches[k].tokens.numel() for p in padded} == {want}
        for a, b in zip(plain, padded):
            x, y = a.micro_batches[k], b.micro_batches[k]
            n = x.tokens.numel()
            # the real part is unchanged; the padding is its own attention block, never trained
            assert torch.equal(y.tokens[:n], x.tokens) and torch.equal(y.resp_index, x.resp_index)
            assert y.seq_lens[:len(x.seq_lens)] == x.seq_lens and sum(y.seq_lens) == want
            assert y.position_ids[n:].tolist() == list(range(want - n))
            assert y.num_tokens == x.num_tokens and torch.equal(y.labels, x.labels)
    assert any(len(p.micro_batches[k].seq_lens) > len(q.micro_batches[k].seq_lens)
               for p, q in zip(padded, plain) for k in range(len(p.micro_batches)))


def test_filler_micro_batch_is_masked():
    mb = build_micro_batch(_samples([(1, 1)]), [], [1])
    assert mb.num_tokens == 0 and mb.loss_mask.sum() == 0 and mb.tokens.numel() == 1


def test_sample_validation():
    with pytest.raises(ValueError, match="prompt_ids"):
        Sample(prompt_ids=[], response_ids=[1], advantage=0.0, prompt_index=0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        Sample(prompt_ids=[1], response_ids=[1, 2], advantage=0.0, prompt_index=0,
               rollout_logprobs=[0.0])


def test_cu_seqlens_are_the_packed_sequence_bounds():
    s = _samples([(3, 2), (2, 4), (1, 1)])
    mb = build_micro_batch(s, [0, 1, 2], [2, 4, 1], pad_to=16)
    assert cu_seqlens(mb.seq_lens) == [0, 5, 11, 13, 16]  # the padding segment is its own sequence
    assert cu_seqlens(mb.seq_lens)[-1] == mb.tokens.numel()
    with pytest.raises(ValueError, match="> 0"):
        cu_seqlens([3, 0])


def test_row_multiple_pads_rows_for_sequence_parallelism():
    s = _samples([(3, 2), (2, 4), (1, 2), (4, 1)] * 2)
    lens, _ = trim_lengths(s, 16)
    plain = plan_mini_batch(s, list(range(8)), lens, dp=2, dp_rank=1, budget=16)
    padded = plan_mini_batch(s, list(range(8)), lens, dp=2, dp_rank=1, budget=16, row_multiple=4)
    for a, b in zip(plain.micro_batches, padded.micro_batches):
        n = a.tokens.numel()
        assert b.tokens.numel() == -(-n // 4) * 4 and torch.equal(b.tokens[:n], a.tokens)
        assert torch.equal(b.resp_index, a.resp_index) and b.seq_lens[:len(a.seq_lens)] == a.seq_lens
    assert any(a.tokens.numel() % 4 for a in plain.micro_batches)  # padding was needed somewhere
