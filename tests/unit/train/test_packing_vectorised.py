"""Vectorised packing and per-token inputs equal a plain per-token construction."""

from __future__ import annotations

import random

import torch

from megatron_maspo.train.actor.packing import build_micro_batch, token_inputs
from megatron_maspo.train.actor.samples import Sample


def _samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        p = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
        r = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
        out.append(Sample(prompt_ids=p, response_ids=r, advantage=rng.uniform(-1, 1),
                          prompt_index=k // 3, rollout_logprobs=[-rng.random() for _ in r],
                          old_logprobs=-torch.rand(len(r))))
    return out


def _reference(samples, index, resp_lens):
    """Token-by-token construction (what the packing did before it was vectorised)."""
    toks, pos, ridx, labels, sids, adv, pid, old, roll = [], [], [], [], [], [], [], [], []
    for i in index:
        s, n = samples[i], resp_lens[i]
        start, p = len(toks), len(s.prompt_ids)
        toks += s.prompt_ids + s.response_ids[:n]
        pos += range(p + n)
        for j in range(n):
            ridx.append(start + p - 1 + j)
            labels.append(s.response_ids[j])
            sids.append(i)
            adv.append(s.advantage)
            pid.append(s.prompt_index)
            old.append(float(s.old_logprobs[j]))
            roll.append(s.rollout_logprobs[j])
    return toks, pos, ridx, labels, sids, adv, pid, old, roll


def test_build_micro_batch_and_token_inputs_match_per_token_reference():
    samples = _samples(12, seed=3)
    resp_lens = [max(0, len(s.response_ids) - (k % 3)) for k, s in enumerate(samples)]
    for index in ([0], [1, 4, 7], [2, 3, 5, 8, 9, 11], list(range(12))):
        mb = build_micro_batch(samples, index, resp_lens, pad_to=200)
        toks, pos, ridx, labels, sids, adv, pid, old, roll = _reference(samples, index, resp_lens)
        s = len(toks)
        assert mb.tokens[:s].tolist() == toks and mb.position_ids[:s].tolist() == pos
        assert mb.tokens.numel() == 200 and mb.position_ids[s:].tolist() == list(range(200 - s))
        assert mb.resp_index.tolist() == ridx and mb.labels.tolist() == labels
        assert mb.seq_ids.tolist() == sids and mb.num_tokens == len(labels)
        assert mb.seq_lens[:-1] == [len(samples[i].prompt_ids) + resp_lens[i] for i in index]
        assert mb.loss_mask.tolist() == [1.0] * len(labels)
        # the label of every response position is the token right after it
        assert torch.equal(mb.tokens[mb.resp_index + 1], mb.labels)
        got = token_inputs(samples, mb)
        assert torch.allclose(got["advantages"], torch.tensor(adv))
        assert got["prompt_ids"].tolist() == pid
        assert torch.allclose(got["old_logprobs"], torch.tensor(old))
        assert torch.allclose(got["rollout_logprobs"], torch.tensor(roll))
        assert got["ref_logprobs"] is None  # not every sample has one


def test_filler_row():
    mb = build_micro_batch(_samples(2, 0), [], [1, 1])
    got = token_inputs([], mb)
    assert mb.tokens.tolist() == [0] and mb.loss_mask.tolist() == [0.0]
    assert got["advantages"].tolist() == [0.0] and got["prompt_ids"].tolist() == [0]
