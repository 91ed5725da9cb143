"""MASPO_FAULT parsing and the two hooks (raise at a step, NaN log-probs at a step) on one rank."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.train.process import faults


@pytest.fixture
def fault(monkeypatch):
    def set_(text: str | None):
        if text is None:
            monkeypatch.delenv(faults.ENV, raising=False)
        else:
            monkeypatch.setenv(faults.ENV, text)
        faults.configured.cache_clear()
    yield set_
    faults.configured.cache_clear()


@pytest.mark.parametrize("text, fragment", [
    ("rank=1,step=2", "needs rank, step and kind"),
    ("rank=1,step=2,kind=crash", "kind must be one of"),
    ("rank=a,step=2,kind=raise", "integers"),
    ("rank=1,step=2,kind=raise,x=1", "expected"),
])
def test_bad_spec_is_a_clear_error(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        faults.parse_fault(text)


def test_unset_means_no_fault(fault):
    fault(None)
    assert faults.configured() is None
    inj = faults.FaultInjector(faults.configured(), rank=0)
    assert inj.at_step(0) is None and inj.at_step(2) is None


def test_raise_only_on_the_chosen_rank_and_step(fault):
    fault("rank=0,step=2,kind=raise")
    assert faults.configured() == faults.Fault(rank=0, step=2, kind="raise")
    inj = faults.FaultInjector(faults.configured(), rank=0)
    assert inj.at_step(1) is None
    with pytest.raises(faults.InjectedFault, match="rank 0 at step 2"):
        inj.at_step(2)
    assert faults.FaultInjector(faults.configured(), rank=1).at_step(2) is None  # another rank


def test_nan_hook_only_at_its_step(fault):
    fault("rank=0,step=3,kind=nan")
    inj = faults.FaultInjector(faults.configured(), rank=0)
    lp, mask = torch.zeros(4), torch.tensor([False, True, True, False])
    assert inj.at_step(2) is None  # a nan fault never raises, and is off at other steps
    hook = inj.at_step(3)
    out = hook(lp, mask)
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2, 3]]).all()
    assert hook(lp, torch.zeros(4, dtype=torch.bool)) is lp  # nothing valid: unchanged
