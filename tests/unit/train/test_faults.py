"""MASPO_FAULT parsing and the two hooks (raise at a step, NaN log-probs at a step) on one rank."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.train import faults


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
    faults._current_step = None


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
    faults.at_step(0)
    lp = torch.zeros(3)
    assert faults.poison_logprobs(lp, torch.ones(3, dtype=torch.bool)) is lp


def test_raise_only_on_the_chosen_rank_and_step(fault, monkeypatch):
    fault("rank=0,step=2,kind=raise")
    assert faults.configured() == faults.Fault(rank=0, step=2, kind="raise")
    faults.at_step(1)
    with pytest.raises(faults.InjectedFault, match="rank 0 at step 2"):
        faults.at_step(2)
    monkeypatch.setenv("RANK", "1")  # another rank (no process group here): no fault
    faults.at_step(2)


def test_nan_hits_the_first_valid_token_of_the_chosen_step(fault):
    fault("rank=0,step=3,kind=nan")
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    mask = torch.tensor([False, True, True])
    faults.at_step(2)
    assert torch.isfinite(faults.poison_logprobs(lp, mask)).all()
    faults.at_step(3)  # a nan fault never raises
    out = faults.poison_logprobs(lp, mask)
    assert torch.isnan(out[1]) and out[0] == -1.0 and out[2] == -3.0
    out.nansum().backward()  # the graph stays intact for the other tokens
    assert lp.grad.tolist() == [1.0, 0.0, 1.0]
