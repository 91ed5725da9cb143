"""The trainer's view of supervised engines (``train/rollouts/remote.py::engine_fault_metrics``): job totals
from the latest batch summed over owners, per-step failures and time lost summed over every batch received,
nothing without supervision; and the ``MASPO_ENGINE_FAULT`` parser of the engine processes."""

from __future__ import annotations

import pytest

from megatron_maspo.rollout.supervision.engine_process import fault_from_env
from megatron_maspo.train.rollouts.remote import engine_fault_metrics


def _owner(restarts, reissued, live, failures, lost, detect):
    return {"rollout/engine_restarts": restarts, "rollout/prompts_reissued": reissued,
            "rollout/engines_live": live, "rollout/engine_failures": failures,
            "rollout/engine_time_lost_s": lost, "rollout/engine_detect_s_max": detect}


def test_totals_come_from_the_latest_batch_and_failures_from_every_batch():
    older = [_owner(1, 4, 1, 1, 3.0, 0.2), _owner(0, 0, 1, 0, 0.0, 0.0)]
    latest = [_owner(1, 4, 1, 0, 0.0, 0.0), _owner(1, 2, 0, 1, 5.0, 2.5)]
    out = engine_fault_metrics([older, latest])
    assert out == {"rollout/engine_restarts": 2, "rollout/prompts_reissued": 6, "rollout/engines_live": 1,
                   "rollout/engine_failures": 2, "rollout/engine_time_lost_s": 8.0,
                   "rollout/engine_detect_s_max": 2.5, "rollout/engines_joined": 0.0,
                   "rollout/engines_drained": 0.0}
    assert engine_fault_metrics([]) == {} and engine_fault_metrics([[], []]) == {}  # not supervised


def test_the_fault_variable_targets_one_engine_and_its_first_incarnation():
    assert fault_from_env(1, "engine=1,kind=kill,call=3,step=2") == {"kind": "kill", "epochs": [0], "call": 3,
                                                                    "step": 2}
    assert fault_from_env(0, "engine=1,kind=kill,call=3,step=2") is None
    assert fault_from_env(0, "") is None


@pytest.mark.parametrize("value", ["kind=kill", "engine=x,kind=kill", "engine=0,kind=boom", "engine=0,kind=kill,step"])
def test_a_malformed_fault_variable_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="MASPO_ENGINE_FAULT="):
        fault_from_env(0, value)


def test_each_engines_share_sums_over_the_batches_and_joins_are_job_totals():
    older = [{**_owner(0, 0, 1, 0, 0.0, 0.0), "rollout/engine_prompts/e0": 4.0}]
    latest = [{**_owner(0, 0, 2, 0, 0.0, 0.0), "rollout/engine_prompts/e0": 3.0, "rollout/engine_prompts/e2": 1.0,
               "rollout/engines_joined": 1.0, "rollout/engines_drained": 0.0}]
    out = engine_fault_metrics([older, latest])
    assert out["rollout/engine_prompts/e0"] == 7.0 and out["rollout/engine_prompts/e2"] == 1.0
    assert out["rollout/engines_joined"] == 1.0 and out["rollout/engines_live"] == 2
