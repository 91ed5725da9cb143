"""Mismatch metrics against hand-computed values and the masked / global-count conventions; the
loop's per-step trainer-vs-engine diagnostic (fresh vs stale split, which rank computes, the
broadcast source)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_maspo.rollout import diagnostics
from megatron_maspo.rollout.diagnostics import (
    mismatch_metrics,
    rollout_logprobs_tensor,
    trainer_vs_engine_mismatch,
)
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


def _groups(**kw) -> SimpleNamespace:
    base = dict(is_last_stage=True, tp_rank=0, cp_rank=0, dp_rank=0, pp=1, tp=1, cp=1, dp=1)
    return SimpleNamespace(**{**base, **kw})


def test_trainer_vs_engine_mismatch_splits_fresh_and_stale(monkeypatch):
    old = torch.tensor([-1.0, -2.0])
    s = [SimpleNamespace(old_logprobs=old, rollout_logprobs=[-1.2, -1.9, -7.0], policy_version=3),
         SimpleNamespace(old_logprobs=old, rollout_logprobs=torch.tensor([-1.0, -2.5]),
                         policy_version=2),
         SimpleNamespace(old_logprobs=None, rollout_logprobs=[-1.0], policy_version=3),
         SimpleNamespace(old_logprobs=torch.zeros(0), rollout_logprobs=[], policy_version=3),
         SimpleNamespace(old_logprobs=old, rollout_logprobs=None, policy_version=3)]
    sent = []
    monkeypatch.setattr(diagnostics.comm, "broadcast_object",
                        lambda obj, src: sent.append(src) or obj)
    out = trainer_vs_engine_mismatch(s, 3, _groups())
    # the fresh sample's rollout log-probs are cut to the trained length (its 3rd token was cut)
    fresh = mismatch_metrics(old, torch.tensor([-1.2, -1.9]), torch.ones(2))
    stale = mismatch_metrics(old, torch.tensor([-1.0, -2.5]), torch.ones(2))
    assert out == {**{k: float(v) for k, v in fresh.items()},
                   **{"offpolicy/" + k.removeprefix("mismatch/"): float(v) for k, v in stale.items()}}
    assert sent == [0]


@pytest.mark.parametrize("who", [dict(is_last_stage=False), dict(tp_rank=1), dict(cp_rank=1),
                                 dict(dp_rank=1)])
def test_trainer_vs_engine_mismatch_is_computed_on_one_rank(monkeypatch, who):
    sent = []
    monkeypatch.setattr(diagnostics.comm, "broadcast_object",
                        lambda obj, src: sent.append(src) or obj)
    s = [SimpleNamespace(old_logprobs=torch.tensor([-1.0]), rollout_logprobs=[-1.5],
                         policy_version=0)]
    # (last stage, dp 0, cp 0, tp 0) is global rank (pp-1)*tp*cp*dp in Megatron's tp-cp-ep-dp-pp
    layout = dict(pp=2, tp=2, cp=2, dp=3)
    assert trainer_vs_engine_mismatch(s, 0, _groups(**layout, **who)) == {}
    assert trainer_vs_engine_mismatch(s, 0, _groups(**layout))  # the source rank computes
    assert sent == [12, 12]
