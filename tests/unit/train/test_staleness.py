"""The bounded-staleness schedule (train/rollouts/staleness.py): which weights make which batch, the checkpoint
round trip, the metrics, and the config checks that go with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_maspo.config import MaspoConfig, check_combinations
from megatron_maspo.errors import ConfigError
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.types import Completion
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.rollouts.groups import PromptGroup, RolloutBatch
from megatron_maspo.train.rollouts.staleness import StalenessQueue, staleness_metrics


def _group(i: int, version: int, lp: float = -0.123456789012345) -> PromptGroup:
    comps = [Completion(token_ids=[i, j, 7], logprobs=[lp, lp / 3, -1e-9], finish_reason="stop",
                        policy_version=version) for j in range(2)]
    return PromptGroup(prompt_index=i, prompt_ids=[1, 2, i], answer=str(i), completions_G=comps,
                       rewards_G=[1.0, -0.25], correct_G=[True, False])


def _batch(step: int, version: int) -> RolloutBatch:
    seen = [_group(step * 10 + j, version) for j in range(3)]
    return RolloutBatch(step=step, version=version, kept=seen[1:], seen=seen, dropped=1)


def _simulate(k: int, steps: int) -> dict[int, int]:
    """Run the loop's schedule on plain data: returns {step trained: weight version that made it}."""
    q, made_by = StalenessQueue(k), {}
    for s in range(steps):  # weights at step s are those after s updates
        for t in q.due(s):
            q.push(_batch(t, version=s))
        made_by[s] = q.pop(s).version
    assert len(q) == k  # the last k batches stay queued (checkpointed, trained by a longer run)
    return made_by


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_batch_of_step_s_is_made_by_the_weights_of_step_s_minus_k(k):
    assert _simulate(k, 9) == {s: max(0, s - k) for s in range(9)}


def test_fills_k_plus_one_at_start_then_one_per_step():
    q = StalenessQueue(2)
    assert q.due(0) == [0, 1, 2]
    for t in q.due(0):
        q.push(_batch(t, 0))
    q.pop(0)
    assert q.due(1) == [3]


def test_missing_or_skipped_batches_are_errors_not_regenerated():
    q = StalenessQueue(1)
    with pytest.raises(RuntimeError, match="no rollout batch queued for step 0"):
        q.pop(0)
    q.push(_batch(0, 0))
    q.push(_batch(1, 0))
    with pytest.raises(RuntimeError, match="already queued"):
        q.push(_batch(1, 0))
    with pytest.raises(RuntimeError, match="never trained on"):
        q.pop(1)  # step 0's batch is still pending


def test_state_round_trips_exactly_and_rebases_engine_versions():
    q = StalenessQueue(2)
    b = _batch(5, version=4)
    b.kept.append(_group(99, 2))  # a kept group outside ``seen`` survives too
    experts = torch.tensor([[[0, 3], [1, 2]], [[2, 3], [0, 1]], [[1, 3], [0, 2]]], dtype=torch.int16)
    b.seen[1].completions_G[0].routed_experts = experts  # [P+n-1, layers, k] from the engine (MoE)
    q.push(b)
    q.push(_batch(6, version=5))
    state = q.state(engine_offset=3)  # engine versions v were trainer versions v + 3
    assert set(state) == {"max_staleness", "batches_json"} and isinstance(state["batches_json"], str)
    r = StalenessQueue(2)
    r.load_state(state, engine_offset=5)  # the resumed run's engine counts from a later offset
    assert sorted(r.pending) == [5, 6]
    got, want = r.pending[5], q.pending[5]
    assert (got.step, got.version, got.dropped) == (want.step, want.version, want.dropped)
    assert got.kept[0] is got.seen[1]  # shared, not duplicated
    for g, w in zip(got.kept, want.kept):
        assert (g.prompt_index, g.prompt_ids, g.answer, g.rewards_G, g.correct_G) == \
            (w.prompt_index, w.prompt_ids, w.answer, w.rewards_G, w.correct_G)
        for cg, cw in zip(g.completions_G, w.completions_G):
            assert cg.token_ids == cw.token_ids and cg.finish_reason == cw.finish_reason
            assert cg.logprobs == cw.logprobs  # bit-exact floats through JSON
            assert cg.policy_version + 5 == cw.policy_version + 3  # same absolute version
            assert (cg.routed_experts is None) == (cw.routed_experts is None)
            if cw.routed_experts is not None:
                assert cg.routed_experts.dtype == cw.routed_experts.dtype
                assert torch.equal(cg.routed_experts, cw.routed_experts)
    empty = StalenessQueue(2)
    empty.load_state(None, engine_offset=0)
    assert len(empty) == 0


def test_staleness_metrics_count_lags_and_tokens():
    def s(v: int, n: int) -> Sample:
        return Sample(prompt_ids=[1], response_ids=list(range(n)), advantage=0.0, prompt_index=0,
                      policy_version=v)

    m = staleness_metrics([s(5, 3), s(3, 4), s(3, 2), s(4, 1)], version=5, max_staleness=2)
    assert m["rollout/staleness_mean"] == pytest.approx((0 + 2 + 2 + 1) / 4)
    assert m["rollout/staleness_max"] == 2.0
    assert (m["rollout/tokens_stale_0"], m["rollout/tokens_stale_1"], m["rollout/tokens_stale_2"]) == (3, 1, 6)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_staleness_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutConfig(max_staleness=bad)


def test_staleness_needs_truncated_is_whatever_the_override_order():
    with pytest.raises(ValueError, match="needs loss.tis_cap"):
        check_combinations(MaspoConfig(rollout=RolloutConfig(max_staleness=2)))
    check_combinations(MaspoConfig(rollout=RolloutConfig(max_staleness=2), loss=LossConfig(tis_cap=2.0)))
    with pytest.raises(ConfigError, match="needs loss.tis_cap"):
        resolve_config("tiny", None, ["rollout.max_staleness=2"])
    for order in (["rollout.max_staleness=2", "loss.tis_cap=2.0"], ["loss.tis_cap=2.0", "rollout.max_staleness=2"]):
        cfg = resolve_config("tiny", None, order)
        assert cfg.rollout.max_staleness == 2 and cfg.loss.tis_cap == 2.0
    assert dataclasses.replace(MaspoConfig()).rollout.max_staleness == 0  # the default: synchronous


def test_staleness_accepts_any_rollout_correction_mode():
    """Issue 34: the stale-sample checks read loss.rollout_correction (tis_cap is its alias)."""
    from megatron_maspo.loss.params import RolloutCorrectionParams
    from megatron_maspo.train.loop import _version_check

    for mode in ("icepop", "token_mask", "seq_mask"):
        loss = LossConfig(rollout_correction=RolloutCorrectionParams(mode=mode))
        check_combinations(MaspoConfig(rollout=RolloutConfig(max_staleness=2), loss=loss))
    cfg = resolve_config("tiny", None, ["rollout.max_staleness=2", "loss.rollout_correction.mode=icepop"])
    assert cfg.loss.corrects_rollout and cfg.loss.tis_cap is None
    stale = [type("S", (), {"policy_version": 0})()]
    with pytest.raises(RuntimeError, match="rollout_correction"):
        _version_check(stale, 1, MaspoConfig().loss.corrects_rollout)
    _version_check(stale, 1, cfg.loss.corrects_rollout)  # a correction is configured: accepted


def test_tis_cap_alias_can_be_overridden_again():
    cfg = resolve_config("tiny", None, ["loss.tis_cap=2.0", "rollout.max_staleness=1", "loss.tis_cap=3.0"])
    assert cfg.loss.effective_rollout_correction.cap == 3.0
    with pytest.raises(ConfigError, match="tis_cap"):
        resolve_config("tiny", None, ["loss.tis_cap=2.0", "loss.rollout_correction.mode=icepop"])
