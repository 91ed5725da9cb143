"""The pure bookkeeping of supervised engines (``rollout/supervision/``): chunks cover a round exactly,
a failed engine's running chunks go back to the head of the queue in order and are counted once, a late
answer from a failed incarnation is refused, the silence rule times only engines that owe progress, the
restart budget is job-wide, the failure line names engine, host, cause and budget, and the config
refuses bad values of the new fields."""

from __future__ import annotations

import pytest

from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.supervision.health import (
    EngineFailure,
    EngineSlot,
    RestartBudget,
    SlotState,
    failure_line,
    link_prefix,
    next_deadline,
    overdue,
)
from megatron_maspo.rollout.supervision.ledger import Chunk, WorkLedger, split_chunks


@pytest.mark.parametrize("prompts,chunks", [(1, 1), (7, 3), (8, 4), (3, 8), (32, 5)])
def test_chunks_cover_the_round_contiguously_and_evenly(prompts, chunks):
    out = split_chunks(prompts, chunks)
    assert len(out) == min(prompts, chunks)
    assert [c.index for c in out] == list(range(len(out)))
    assert out[0].start == 0 and out[-1].stop == prompts
    assert all(a.stop == b.start for a, b in zip(out, out[1:]))
    sizes = [c.prompts for c in out]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("prompts,chunks", [(0, 2), (4, 0)])
def test_split_refuses_an_empty_round(prompts, chunks):
    with pytest.raises(ValueError, match="must be >= 1"):
        split_chunks(prompts, chunks)


def test_a_failed_engines_chunks_are_reissued_first_in_order_and_counted_once():
    led = WorkLedger(split_chunks(10, 5))  # 5 chunks of 2 prompts
    assert led.assign(0, 0, now=1.0).index == 0
    assert led.assign(1, 0, now=1.5).index == 1
    assert led.assign(1, 0, now=2.0).index == 2  # an engine may hold more than one
    assert led.complete(0, 0, 0, "r0")
    lost = led.fail(1)
    assert [a.chunk.index for a in lost] == [1, 2] and [a.since for a in lost] == [1.5, 2.0]
    assert led.reissued_prompts == 4 and led.reissued_chunks == 2
    assert list(led.pending) == [1, 2, 3, 4]  # the oldest work first, ahead of the never-started
    assert led.fail(1) == [] and led.reissued_prompts == 4  # nothing running there any more
    order = [led.assign(0, 0, now=3.0).index for _ in range(4)]
    assert order == [1, 2, 3, 4] and led.assign(0, 0, now=3.0) is None
    for i in order:
        assert led.complete(i, 0, 0, f"r{i}")
    assert led.finished and led.results() == ["r0", "r1", "r2", "r3", "r4"]


def test_a_late_answer_of_a_failed_incarnation_is_refused():
    led = WorkLedger(split_chunks(4, 2))
    led.assign(1, 0, now=0.0)  # chunk 0 on engine 1, epoch 0
    led.fail(1)
    assert led.assign(1, 1, now=1.0).index == 0  # re-issued to the restarted engine (epoch 1)
    assert not led.complete(0, 1, 0, "stale")  # the hung epoch 0 woke up and answered
    assert 0 not in led.done and led.running[0].epoch == 1
    assert led.complete(0, 1, 1, "fresh") and led.done[0] == "fresh"
    assert not led.complete(0, 1, 1, "again")  # done already: never counted twice


def test_results_of_an_unfinished_round_name_the_missing_chunks():
    led = WorkLedger(split_chunks(3, 3))
    led.assign(0, 0, now=0.0)
    led.complete(0, 0, 0, "r0")
    with pytest.raises(RuntimeError, match=r"chunks \[1, 2\] have no result"):
        led.results()
    with pytest.raises(ValueError, match="indexed 0, 1"):
        WorkLedger([Chunk(1, 0, 2)])


def test_only_engines_that_owe_progress_are_timed():
    slot = EngineSlot(3)
    for state in (SlotState.IDLE, SlotState.DEAD):
        slot.mark(state, now=0.0)
        assert overdue(slot, 1e9, timeout_s=5, start_timeout_s=60) is None
    slot.mark(SlotState.BUSY, now=10.0)
    slot.chunk = 2
    assert overdue(slot, 15.0, timeout_s=5, start_timeout_s=60) is None  # exactly at the limit: not yet
    cause = overdue(slot, 15.5, timeout_s=5, start_timeout_s=60)
    assert cause == "hung: no progress for 5.5 s while generating chunk 2 (rollout.engine_timeout_s=5)"
    slot.mark(SlotState.LOADING, now=10.0)
    assert "while loading weights" in overdue(slot, 16.0, timeout_s=5, start_timeout_s=60)
    slot.mark(SlotState.STARTING, now=10.0)  # starting has its own, longer limit
    assert overdue(slot, 16.0, timeout_s=5, start_timeout_s=60) is None
    assert "rollout.engine_start_timeout_s=60" in overdue(slot, 71.0, timeout_s=5, start_timeout_s=60)


def test_the_next_deadline_is_the_earliest_timed_slot():
    a, b, c = EngineSlot(0), EngineSlot(1), EngineSlot(2)
    a.mark(SlotState.BUSY, now=10.0)
    b.mark(SlotState.STARTING, now=0.0)
    c.mark(SlotState.IDLE, now=0.0)
    assert next_deadline([a, b, c], timeout_s=5, start_timeout_s=60) == 15.0
    assert next_deadline([c], timeout_s=5, start_timeout_s=60) is None


def test_the_restart_budget_is_spent_once_per_restart_and_refuses_past_it():
    budget = RestartBudget(2)
    assert budget.take() and budget.take() and not budget.take()
    assert budget.used == 2
    assert not RestartBudget(0).take()


def test_the_failure_line_names_engine_host_cause_and_budget():
    f = EngineFailure(engine=1, epoch=0, host="node7", pid=4242, cause="killed by SIGKILL", detected_at=5.0,
                      silent_s=0.1, lost_s=2.0, prompts_reissued=4)
    assert failure_line(f, restart=1, budget=3) == (
        "rollout engine 1 on host node7 (pid 4242, epoch 0) failed: killed by SIGKILL; 4 prompts re-issued; "
        "restart 1 of 3 (rollout.max_engine_restarts)")
    line = failure_line(f, restart=None, budget=3)
    assert "\n" not in line and line.endswith("no restart left: rollout.max_engine_restarts=3 spent")
    assert f.time_lost_s == 2.0
    f.restart_s = 3.5
    assert f.time_lost_s == 5.5


def test_each_incarnation_has_its_own_link_name():
    names = {link_prefix(e, n) for e in range(3) for n in range(3)}
    assert len(names) == 9 and link_prefix(1, 2) == "rollout_engines/e1/epoch2"


@pytest.mark.parametrize("field,value,match", [
    ("engine_timeout_s", 0.0, "engine_timeout_s must be > 0"),
    ("engine_start_timeout_s", -1.0, "engine_start_timeout_s must be > 0"),
    ("max_engine_restarts", -1, "max_engine_restarts must be an integer >= 0"),
    ("max_engine_restarts", 1.5, "max_engine_restarts must be an integer >= 0"),
    ("max_engine_restarts", True, "max_engine_restarts must be an integer >= 0"),
])
def test_config_refuses_bad_engine_fault_settings(field, value, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**{field: value})
    assert RolloutConfig(max_engine_restarts=0).max_engine_restarts == 0


@pytest.mark.parametrize("over,match", [
    ({}, "applies only to rollout.placement=disaggregated"),
    ({"placement": "disaggregated", "engine_ranks": 1, "in_flight_updates": True}, "in_flight_updates"),
])
def test_config_refuses_supervision_where_it_cannot_run(over, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(supervise_engines=True, **over)
    assert RolloutConfig(supervise_engines=True, placement="disaggregated", engine_ranks=1).supervise_engines
    assert RolloutConfig(supervise_engines=True, placement="disaggregated", engine_ranks=1, engine="vllm")
