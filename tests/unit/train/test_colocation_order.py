"""Colocated phase order (issue 29, defect 7): the engine's KV cache wakes only after the trainer's state
left the GPU, and the state comes back only after the engine slept. Before the fix the sync woke vLLM's
weights *and* KV cache with the whole trainer state still resident, and the offload ran a step later.
Issue 56: the gradients and optimizer state leave before the engine's weights wake (the sync reads only
the parameters), so the engine's weights never share the GPU with them.

Runs the real built-in engine (its sleep frees the weights' storage) and the real offloader on CPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout.builtin_engine import BuiltinEngine
from megatron_maspo.rollout.types import SamplingParams
from megatron_maspo.train.actor.offload import (
    CATEGORIES,
    STEP_PHASES,
    Colocation,
    StateOffloader,
    phase_order,
    phase_peaks,
    training_tensors,
)

PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3)


def test_phase_order_is_data():
    order = phase_order()
    assert order == ("offload_trainer", "wake_kv_cache", "generate", "sleep_engine", "reload_trainer",
                     "train", "offload_state", "wake_weights", "sync")
    assert order.index("offload_trainer") < order.index("wake_kv_cache")
    by = {p.name: p.resident for p in STEP_PHASES}
    assert "offloaded_params" not in by["wake_kv_cache"] and "kv_cache" not in by["sync"]
    assert "kv_cache" not in by["train"] and "engine_weights" not in by["train"]
    assert "offloaded_state" not in by["wake_weights"] and "offloaded_state" not in by["sync"]
    peaks = phase_peaks({"trainer_kept": 1, "offloaded_params": 4, "offloaded_state": 6, "engine_weights": 2,
                         "kv_cache": 20, "activations": 5, "buckets": 1})
    assert peaks["generate"] == 23 and peaks["train"] == 16 and peaks["sync"] == 8


class _Recorder(BuiltinEngine):
    """The built-in engine, logging each call with the trainer's offload state at that moment."""

    def __init__(self, model, offloader, log):
        super().__init__(model, device="cpu")
        self._off, self._log = offloader, log

    def _note(self, what):
        self._log.append((what, tuple(sorted(self._off.offloaded_categories))))

    def sleep(self, level=1):
        self._note(f"sleep{level}")
        super().sleep(level)

    def wake_up(self, tags=None):
        if set(tags or ("weights", "kv_cache")) & self._sleeping:  # a call that wakes something
            self._note(f"wake{list(tags) if tags else ''}")
        super().wake_up(tags)

    def load_weights(self, weights):
        self._note("load")
        super().load_weights(weights)

    def generate(self, prompts, params, **kw):
        self._note("generate")
        return super().generate(prompts, params, **kw)


@pytest.mark.parametrize("level", [1, 2])
def test_step_runs_the_phases_in_order_with_the_builtin_engine_and_offloader(level):
    torch.manual_seed(0)
    trainer = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    trainer(torch.randn(2, 16)).sum().backward()
    opt.step()
    off = StateOffloader(functools.partial(training_tensors, [trainer], opt), enabled=CATEGORIES)
    log: list[tuple[str, bool]] = []
    model, _ = make_tiny_hf_model("qwen2", vocab_size=64, seed=0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    col = Colocation(off, sleep_level=level)
    engine = col.start_engine(lambda: _Recorder(model, off, log))
    # started with the trainer offloaded, then asleep with the trainer back
    assert [e for e, _ in log] == [f"sleep{level}"] and log[0][1] == tuple(sorted(CATEGORIES))
    assert not off.offloaded
    log.clear()
    col.prepare_sync()
    engine.load_weights(weights.items())  # the initial sync
    for _ in range(2):  # two steps
        col.trace.clear()
        assert col.prepare_generation() == sum(off.bytes_by_category.values()) > 0
        engine.generate([[1, 2, 3]], PARAMS)
        col.prepare_update()
        assert all(p.untyped_storage().nbytes() > 0 for p in trainer.parameters())  # "train" can run
        col.prepare_sync()
        engine.load_weights(weights.items())  # "sync"
        assert col.trace == [p for p in phase_order() if p not in ("generate", "train", "sync")]
    wake_w = ["wake['weights']"] if level == 1 else []  # level 2: the load re-allocates the weights
    every, state = tuple(sorted(CATEGORIES)), ("grads", "optimizer")  # the sync: params on the GPU, no more
    step = [("wake['kv_cache']", every), ("generate", every), (f"sleep{level}", every),
            *[(w, state) for w in wake_w], ("load", state)]
    first = [(w, state) for w in wake_w] + [("load", state)]
    assert log == first + step + step
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())


def test_a_checkpoint_after_the_sync_puts_the_engine_to_sleep_before_the_state_comes_back():
    """A stop signal after the sync: the checkpoint needs the whole state, so the engine sleeps first (its
    weights and the trainer's state never add up) and then the state comes back."""
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    off = StateOffloader(functools.partial(training_tensors, [m], opt), enabled=CATEGORIES)
    model, _ = make_tiny_hf_model("qwen2", vocab_size=64, seed=0)
    log: list = []
    col = Colocation(off, sleep_level=1)
    col.start_engine(lambda: _Recorder(model, off, log))
    col.prepare_sync()
    assert off.offloaded_categories == {"grads", "optimizer"} and "offload_state" in col.trace
    log.clear()
    col.make_resident()
    assert log == [("sleep1", ("grads", "optimizer"))] and not off.offloaded
    col.make_resident()  # nothing offloaded: nothing moves
    assert len(log) == 1


def test_sync_refuses_an_offloaded_trainer():
    m = torch.nn.Linear(4, 4)
    off = StateOffloader(functools.partial(training_tensors, [m], None), enabled=("params",))
    col = Colocation(off)
    col.prepare_generation()
    with pytest.raises(RuntimeError, match="offloaded"):
        col.prepare_sync()


def test_barriers_only_when_an_engine_spans_other_ranks_gpus():
    calls = []
    m = torch.nn.Linear(4, 4)
    off = StateOffloader(functools.partial(training_tensors, [m], None), enabled=("params",))
    col = Colocation(off, spans_ranks=True, barrier=lambda: calls.append(1))
    col.start_engine(None)  # a rank without an engine still offloads and meets the others
    assert len(calls) == 3  # after the offload, after the engine started, after it slept
    col.prepare_sync()
    col.prepare_generation()
    col.prepare_update()
    assert len(calls) == 5
