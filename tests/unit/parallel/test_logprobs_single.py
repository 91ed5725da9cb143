"""Single-rank (group=None) checks of the vocab-parallel log-prob/entropy functions.

Multi-rank parity against a float64 reference lives in tests/distributed/test_logprobs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden
from megatron_maspo.parallel.logprobs import count_sweeps


def _inputs(t=9, v=13, padded=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(t, padded, generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[1] = -100
    return z, labels


def test_gradcheck_float64_all_outputs_with_temperature_and_padding():
    z, labels = _inputs()
    z.requires_grad_()

    def fn(z):
        return vocab_parallel_logprobs(z, labels, temperature=0.7, chunk_size=4, vocab_size=13,
                                       return_lse=True)

    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-7)


def test_gradcheck_float64_from_hidden():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 9, 3, -100, 10, 1, 4])

    def fn(h, w):
        return vocab_parallel_logprobs_from_hidden(h, w, labels, temperature=1.3, chunk_size=3,
                                                   vocab_size=11)

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-7)


def test_ignored_padded_and_bounds():
    z, labels = _inputs(dtype=torch.float32)
    z.requires_grad_()
    before = z.detach().clone()
    lp, ent = vocab_parallel_logprobs(z, labels, vocab_size=13)
    assert torch.equal(z.detach(), before), "input logits were modified in place"
    assert lp[1] == 0 and bool((lp <= 0).all())
    assert bool((ent >= 0).all()) and bool((ent <= math.log(13) + 1e-6).all())
    ref = torch.distributions.Categorical(logits=z.detach()[:, :13]).entropy()
    torch.testing.assert_close(ent, ref, rtol=0, atol=1e-5)  # entropy valid on the ignored row too
    lp.sum().backward()
    assert bool((z.grad[:, 13:] == 0).all()), "padded rows must get zero gradient"
    assert bool((z.grad[1] == 0).all()), "an ignored label contributes no log-prob gradient"


def test_low_entropy_large_logits_are_exact():
    # One dominant logit at a large scale: lse - Σp·x would cancel catastrophically in fp32.
    z = torch.full((3, 50), -1e4)
    z[:, 7] = 1e4
    z[1, 8] = 1e4 - 5.0
    lp, ent = vocab_parallel_logprobs(z, torch.tensor([7, 7, 8]))
    ref = torch.distributions.Categorical(logits=z.double()).entropy()
    torch.testing.assert_close(ent.double(), ref, rtol=1e-4, atol=1e-9)
    assert ent[0] == 0 and ent[1] > 0


def test_one_sweep_per_chunk_and_chunk_default():
    z, labels = _inputs(t=10, dtype=torch.float32)
    z.requires_grad_()
    with count_sweeps() as sweeps:
        lp, ent = vocab_parallel_logprobs(z, labels, chunk_size=3, vocab_size=13)
        (lp + ent).sum().backward()
    assert (sweeps.forward, sweeps.backward) == (4, 4)
    with count_sweeps() as sweeps, torch.no_grad():
        vocab_parallel_logprobs(z, labels, vocab_size=13)
    assert (sweeps.forward, sweeps.backward) == (1, 0)


def test_empty_token_batch():
    z = torch.zeros(0, 8, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(z, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert z.grad.shape == (0, 8)


@pytest.mark.parametrize("kwargs, labels, exc, match", [
    ({}, torch.tensor([0, 16, 1]), ValueError, "labels must be in"),
    ({"vocab_size": 13}, torch.tensor([0, 13, 1]), ValueError, "vocab_size=13"),
    ({}, torch.tensor([0.0, 1.0, 2.0]), TypeError, "integer tensor"),
    ({}, torch.tensor([0, 1]), ValueError, "labels must be"),
    ({"temperature": 0.0}, torch.tensor([0, 1, 2]), ValueError, "temperature"),
    ({"vocab_size": 17}, torch.tensor([0, 1, 2]), ValueError, "vocab_size"),
    ({"chunk_size": 0}, torch.tensor([0, 1, 2]), ValueError, "chunk_size"),
])
def test_bad_arguments_raise(kwargs, labels, exc, match):
    with pytest.raises(exc, match=match):
        vocab_parallel_logprobs(torch.zeros(3, 16), labels, **kwargs)


def test_from_hidden_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="weight"):
        vocab_parallel_logprobs_from_hidden(torch.zeros(3, 4), torch.zeros(8, 5),
                                            torch.zeros(3).long())
    with pytest.raises(TypeError, match="dtype"):
        vocab_parallel_logprobs_from_hidden(torch.zeros(3, 4),
                                            torch.zeros(8, 4, dtype=torch.float64),
                                            torch.zeros(3).long())
