"""Mismatch metrics against hand-computed values and the masked / global-count conventions."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.rollout.diagnostics import mismatch_metrics, rollout_logprobs_tensor
from megatron_maspo.rollout.types import Completion


def test_values_mask_and_global_count():
    train = torch.tensor([-1.0, -2.0, -0.5, -9.0])
    roll = torch.tensor([-1.2, -1.9, -0.5, 0.0])
    mask = torch.tensor([1, 1, 1, 0])
    m = mismatch_metrics(train, roll, mask)
    d = [0.2, -0.1, 0.0]
    assert m["mismatch/logprob_abs_diff_mean"].item() == pytest.approx(sum(map(abs, d)) / 3, abs=1e-6)
    assert m["mismatch/logprob_abs_diff_max"].item() == pytest.approx(0.2, abs=1e-6)
    assert m["mismatch/prob_ratio_err_mean"].item() == pytest.approx(sum(abs(math.exp(x) - 1) for x in d) / 3, abs=1e-6)
    assert m["mismatch/kl_k1"].item() == pytest.approx(-sum(d) / 3, abs=1e-6)
    assert m["mismatch/kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3, abs=1e-6)
    g = mismatch_metrics(train, roll, mask, num_tokens_global=6)
    assert g["mismatch/kl_k3"].item() == pytest.approx(m["mismatch/kl_k3"].item() / 2, rel=1e-5)
    same = mismatch_metrics(train, train.clone(), mask)
    assert all(v.item() == pytest.approx(1.0 if k.endswith("ratio_mean") else 0.0) for k, v in same.items())
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_metrics(train, roll[:3], mask)


def test_rollout_logprobs_per_sample():
    cs = [Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="length"),
          Completion(token_ids=[3], logprobs=[-0.3], finish_reason="stop")]
    out = rollout_logprobs_tensor(cs)
    assert [t.tolist() for t in out] == [pytest.approx([-0.1, -0.2]), pytest.approx([-0.3])]
    with pytest.raises(ValueError, match="log-probs"):
        rollout_logprobs_tensor([Completion(token_ids=[1], logprobs=[], finish_reason="stop")])
