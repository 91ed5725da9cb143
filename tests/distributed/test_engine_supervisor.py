"""Supervised rollout engines, real processes (``rollout/supervision/``): two built-in engines, each in an
OS process of its own, make two rounds (weight versions 1 and 2) of a tiny model.

- uninterrupted, the rounds equal one in-process engine's: chunking and processes change nothing;
- SIGKILL of one engine in the middle of a generation: its chunks are re-issued, both rounds equal the
  uninterrupted run (tokens, log-probs, versions), one restart counted, the restarted engine loads the
  current weights (digest-checked) and serves round 2, and no engine process is left afterwards;
- SIGSTOP: detected as a hang within ``engine_timeout_s`` (plus one poll), same results;
- an error raised inside generation: reported with its cause, same results;
- a restarted engine whose re-sent weights are corrupted: the digest check stops the job;
- budget spent: one line naming the engine and ``rollout.max_engine_restarts``, nothing left running.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_maspo.errors import WeightVerifyError
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.model.hf_config import hf_config_dict
from megatron_maspo.model.spec import tiny_qwen2_spec
from megatron_maspo.rollout.builtin_engine import BuiltinEngine, synced_tensors
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.supervision.engine_process import EngineLaunch
from megatron_maspo.rollout.supervision.health import RestartBudgetSpent
from megatron_maspo.rollout.supervision.supervisor import EngineSupervisor
from megatron_maspo.rollout.types import SamplingParams

SPEC = tiny_qwen2_spec(vocab_size=64, num_layers=1, hidden_size=32)
PROMPTS = [[1 + i, 2 + (i % 5), 3, 4 + i] for i in range(12)]  # round of 12 prompts
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=48, seed=11, first_prompt=4)
CHUNKS = 6

pytestmark = pytest.mark.timeout(180)  # a lost chunk or a missed failure would wait forever: fail instead


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC), device="cpu")
    return [(n, t.detach().clone()) for n, t in synced_tensors(engine.model).items()]


def _flat(rounds):
    return [[(c.token_ids, c.logprobs, c.finish_reason, c.policy_version) for c in per] for r in rounds for per in r]


class Events:
    """Every report the supervisor passes to its hook, plus an optional action on engine 1's first
    progress report inside round 1 (the SIGKILL / SIGSTOP of the tests)."""

    def __init__(self, signum: int | None = None) -> None:
        self.signum, self.fired, self.pids, self.log = signum, None, set(), []

    def __call__(self, kind: str, slot) -> None:
        self.log.append((kind, slot.engine, slot.epoch, slot.chunk))
        if slot.pid is not None:
            self.pids.add(slot.pid)
        if (self.signum is not None and self.fired is None and kind == "progress" and slot.engine == 1
                and slot.epoch == 0 and slot.chunk is not None):
            self.fired = (slot.pid, time.monotonic())
            os.kill(slot.pid, self.signum)  # in the middle of a chunk: the engine is between decode steps


def _run(*, signum=None, faults=None, timeout_s=30.0, max_restarts=2, events=None):
    events = events or Events(signum)
    launch = EngineLaunch(engine=0, epoch=0, rollout=RolloutConfig(), model=ModelConfig(), spec=SPEC, seed=1)
    sup = EngineSupervisor(launch, 2, timeout_s=timeout_s, start_timeout_s=120.0, max_restarts=max_restarts,
                           faults=faults, hook=events)
    try:
        sup.start()
        rounds, metrics = [], []
        for version, seed in ((1, 0), (2, 1)):
            sup.load_weights(_weights(seed), version)
            rounds.append(sup.generate(PROMPTS, PARAMS, num_chunks=CHUNKS))
            metrics.append(sup.metrics())
    finally:
        sup.close()
    return rounds, metrics, sup, events


def _assert_nothing_left(pids) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def reference():
    rounds, metrics, sup, events = _run()
    return rounds, metrics, events


def test_uninterrupted_rounds_equal_one_in_process_engine(reference):
    rounds, metrics, events = reference
    for (version, seed), got in zip(((1, 0), (2, 1)), rounds):
        engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC), device="cpu")
        engine.load_weights(_weights(seed))
        want = engine.generate(PROMPTS, PARAMS)
        assert [[c.token_ids for c in per] for per in got] == [[c.token_ids for c in per] for per in want]
        assert all(c.policy_version == version for per in got for c in per)
    assert metrics[-1]["rollout/engine_restarts"] == 0 and metrics[-1]["rollout/prompts_reissued"] == 0
    assert metrics[-1]["rollout/engines_live"] == 2
    assert {e for k, e, *_ in events.log if k == "result"} == {0, 1}  # both engines served
    _assert_nothing_left(events.pids)


def test_an_engine_killed_mid_generation_is_restarted_and_its_prompts_reissued(reference, caplog):
    rounds, metrics, sup, events = _run(signum=signal.SIGKILL)
    assert events.fired is not None
    assert _flat(rounds) == _flat(reference[0])  # tokens, log-probs, finish reasons, versions
    assert metrics[0]["rollout/engine_restarts"] == 1 and metrics[1]["rollout/engine_restarts"] == 1
    assert metrics[0]["rollout/prompts_reissued"] >= 1 and metrics[0]["rollout/engine_failures"] == 1
    assert metrics[1]["rollout/engine_failures"] == 0 and metrics[1]["rollout/engines_live"] == 2
    (f,) = sup.failures
    assert (f.engine, f.epoch, f.cause) == (1, 0, "killed by SIGKILL") and f.pid == events.fired[0]
    assert f.restart_s is not None and f.time_lost_s >= f.restart_s > 0
    # the restarted engine loaded the current weights, then served round 2
    assert ("loaded", 1, 1, None) in events.log
    assert any(k == "result" and (e, n) == (1, 1) for k, e, n, _ in events.log)
    lines = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("rollout engine 1 on host ")
    assert "killed by SIGKILL" in lines[0] and "restart 1 of 2 (rollout.max_engine_restarts)" in lines[0]
    _assert_nothing_left(events.pids)


def test_a_stopped_engine_is_detected_within_the_timeout(reference):
    timeout = 2.0
    rounds, metrics, sup, events = _run(signum=signal.SIGSTOP, timeout_s=timeout)
    assert _flat(rounds) == _flat(reference[0])
    (f,) = sup.failures
    assert f.cause.startswith("hung: no progress for ") and "rollout.engine_timeout_s=2" in f.cause
    detect = f.detected_at - events.fired[1]  # from the stop to the detection
    slack = 1.0  # a loaded 2-core bench may wake the loop late; the rule itself adds at most one poll
    assert timeout - 0.5 < detect <= timeout + sup.poll_s + slack, detect
    assert metrics[0]["rollout/engine_detect_s_max"] <= timeout + sup.poll_s + slack
    assert metrics[-1]["rollout/engine_restarts"] == 1
    _assert_nothing_left(events.pids)  # the stopped process was killed, not left behind


def test_an_error_raised_in_an_engine_is_reported_and_its_chunk_reissued(reference):
    fault = {"kind": "raise", "chunk": 1, "step": 3, "epochs": [0]}
    rounds, metrics, sup, events = _run(faults={1: fault})
    assert _flat(rounds) == _flat(reference[0])
    (f,) = sup.failures
    assert f.engine == 1 and f.prompts_reissued == 2  # chunk 1: prompts 2-3
    assert f.cause.startswith("raised RuntimeError: injected engine fault in chunk 1 at decode step 3")
    _assert_nothing_left(events.pids)


def test_corrupt_weights_in_a_restarted_engine_stop_the_job():
    events = Events(signal.SIGKILL)
    with pytest.raises(WeightVerifyError, match=r"builtin engine 1 \(epoch 1\): tensor "):
        _run(faults={1: {"kind": "flip", "epochs": [1]}}, events=events)
    assert events.fired is not None
    _assert_nothing_left(events.pids)


def test_a_spent_restart_budget_ends_with_one_line_naming_engine_and_budget():
    fault = {"kind": "raise", "step": 2}  # every chunk, every incarnation: both engines keep failing
    events = Events()
    launch = EngineLaunch(engine=0, epoch=0, rollout=RolloutConfig(), model=ModelConfig(), spec=SPEC, seed=1)
    sup = EngineSupervisor(launch, 2, timeout_s=30.0, start_timeout_s=120.0, max_restarts=1,
                           faults={0: fault, 1: fault}, hook=events)
    with sup, pytest.raises(RestartBudgetSpent) as err:
        sup.start()
        sup.load_weights(_weights(0), 1)
        sup.generate(PROMPTS, PARAMS, num_chunks=CHUNKS)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("rollout engine ")
    assert "raised RuntimeError: injected engine fault" in msg
    assert msg.endswith("no restart left: rollout.max_engine_restarts=1 spent")
    assert sup.budget.used == 1 and len(sup.failures) == 2
    _assert_nothing_left(events.pids)
