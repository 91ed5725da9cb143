"""Replay targets follow the packed row: sequences in order, engine rows first, defaults elsewhere."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.train.actor.packing import build_micro_batch
from megatron_maspo.train.actor.routing_replay import replay_targets
from megatron_maspo.train.actor.samples import Sample

L, K = 3, 2


def _sample(p: int, n: int, base: int) -> Sample:
    routed = (torch.arange((p + n - 1) * L * K, dtype=torch.int16) + base).view(p + n - 1, L, K)
    return Sample(prompt_ids=list(range(1, p + 1)), response_ids=list(range(1, n + 1)), advantage=1.0,
                  prompt_index=0, routed_experts=routed)


def test_targets_follow_the_packing_and_fill_the_rest():
    samples = [_sample(3, 4, 0), _sample(2, 5, 1000)]
    mb = build_micro_batch(samples, [1, 0], [2, 5], pad_to=16)  # sample 0 truncated to 2 tokens
    t = replay_targets(samples, mb, num_layers=L, topk=K)
    assert t.shape == (L, 16, K) and t.dtype == torch.long
    # sample 1: 2 + 5 = 7 positions, the engine reported 6 (last response token never fed back)
    assert torch.equal(t[:, :6], samples[1].routed_experts.long().permute(1, 0, 2))
    # sample 0 (truncated, 3 + 2 = 5 positions): its first 5 engine rows
    assert torch.equal(t[:, 7:12], samples[0].routed_experts[:5].long().permute(1, 0, 2))
    default = torch.arange(K).expand(L, K)
    for pos in [6, *range(12, 16)]:  # last token of sample 1, then the padding segment
        assert torch.equal(t[:, pos], default)


def test_missing_or_malformed_routing():
    samples = [_sample(3, 4, 0), _sample(2, 5, 0)]
    samples[1].routed_experts = None
    mb = build_micro_batch(samples, [0, 1], [4, 5])
    assert replay_targets(samples, mb, num_layers=L, topk=K) is None
    samples[1].routed_experts = torch.zeros(6, L, K + 1, dtype=torch.int16)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        replay_targets(samples, mb, num_layers=L, topk=K)
