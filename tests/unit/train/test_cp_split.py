"""A packed micro-batch's CP split: every response token is predicted on exactly one CP rank, at the
local row holding its predictor; sequences are padded to multiples of 2·cp at their end."""

from __future__ import annotations

import torch

from megatron_maspo.train.actor.cp_split import cp_share, local_micro_batch, select_tokens
from megatron_maspo.train.actor.packing import build_micro_batch
from megatron_maspo.train.actor.samples import Sample


def _samples() -> list[Sample]:
    lens = [(3, 4), (5, 1), (2, 9)]  # (prompt, response): 7, 6, 11 tokens, none a multiple of 4
    return [Sample(prompt_ids=list(range(1, p + 1)), response_ids=list(range(50, 50 + r)),
                   advantage=float(i), prompt_index=i) for i, (p, r) in enumerate(lens)]


def test_sequences_are_padded_at_their_end():
    s = _samples()
    mb = build_micro_batch(s, [0, 1, 2], [4, 1, 9], seq_multiple=4)
    assert mb.seq_lens == [8, 8, 12]
    assert mb.tokens[:8].tolist() == [1, 2, 3, 50, 51, 52, 53, 0]
    assert mb.position_ids[:8].tolist() == list(range(8))
    # the predictors of sequence 1's response skip sequence 0's padding
    assert mb.resp_index.tolist()[4] == 8 + 5 - 1
    assert torch.equal(mb.tokens[mb.resp_index + 1], mb.labels)


def test_every_token_on_one_rank_at_its_predictor_row():
    s = _samples()
    mb = build_micro_batch(s, [0, 1, 2], [4, 1, 9], seq_multiple=4)
    shares = [cp_share(mb, 2, r) for r in range(2)]
    keep = torch.cat([sh.keep for sh in shares]).sort().values
    assert torch.equal(keep, torch.arange(mb.labels.numel()))
    for sh in shares:
        loc = local_micro_batch(mb, sh)
        assert torch.equal(sh.rows[loc.resp_index], mb.resp_index[sh.keep])  # same predictor row
        assert torch.equal(loc.labels, mb.labels[sh.keep])
        assert loc.tokens.numel() == sum(mb.seq_lens) // 2
        picked = select_tokens({"adv": torch.arange(mb.labels.numel()).float(), "none": None}, sh)
        assert picked["none"] is None and torch.equal(picked["adv"], sh.keep.float())


def test_a_rank_without_tokens_gets_one_masked_dummy():
    s = [Sample(prompt_ids=[1, 2, 3], response_ids=[7], advantage=1.0, prompt_index=0)]
    mb = build_micro_batch(s, [0], [1], seq_multiple=4)  # the only predictor, row 2, is on rank 1
    empty = cp_share(mb, 2, 0)
    assert empty.dummy and empty.counts == [0, 1]
    loc = local_micro_batch(mb, empty)
    assert loc.loss_mask.tolist() == [0.0] and loc.resp_index.numel() == 1
