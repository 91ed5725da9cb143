"""Vocab-parallel log-prob / entropy on gloo ranks vs a float64 full-vocabulary reference.

Two spawned worlds keep the file fast: a 4-rank world runs TP = 4 (WORLD), TP = 2 (two subgroups
with different data, so using the wrong group fails) and TP = 1 (singleton groups); a 3-rank world
runs TP = 3 with an uneven, padded vocabulary. Megatron's ``parallel_state`` getters are patched to
raise in every rank, so any use of the global state fails the test.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from tests.distributed._launch import run_workers

T, H = 29, 12
CHUNKS = (None, 7)


@contextlib.contextmanager
def _parallel_state_forbidden() -> Iterator[None]:
    """Every ``parallel_state.get_*`` raises inside the block (the explicit group must be used); the
    getters come back after it, so the pooled worker process serves the next test as it was."""
    from megatron.core import parallel_state as ps

    def _boom(*_a, **_k):
        raise AssertionError("parallel_state getter called: the explicit group must be used")

    real = {name: getattr(ps, name) for name in dir(ps) if name.startswith("get_") and callable(getattr(ps, name))}
    for name in real:
        setattr(ps, name, _boom)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(ps, name, fn)


def _data(seed: int, vocab: int, padded: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, padded, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (T,), generator=g)
    labels[0], labels[1], labels[2], labels[5] = vocab - 1, 0, -100, -100  # both ends + ignored
    coef = torch.randn(3, T, generator=g)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(padded, H, generator=g) * (2 / math.sqrt(H))).to(dtype)
    return z, labels, coef, hidden, weight


def _reference(z: torch.Tensor, labels, coef, vocab: int, temperature: float):
    """float64 full-vocabulary log-prob, entropy, lse and the gradient of Σ a·lp + b·H + c·lse."""
    z = z.detach().double().requires_grad_()
    x = z[:, :vocab] / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    keep = labels != -100
    lp = logp_all.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1) * keep
    ent = -(logp_all.exp() * logp_all).sum(-1)
    lse = torch.logsumexp(x, dim=-1)
    (coef.double() * torch.stack([lp, ent, lse])).sum().backward()
    return lp, ent, lse, z.grad


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0):
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    assert bool((err <= bound).all()), f"{name}: max abs error {err.max().item():.3e} (atol {atol})"


def _check_logits(group, rank: int, tp: int, vocab: int, vl: int, seed: int, dtype):
    """Tier 1 at one TP size: values and local-shard gradients, chunking, temperature, lse."""
    from megatron_maspo.parallel import vocab_parallel_logprobs
    from megatron_maspo.parallel.logprobs import count_sweeps

    z, labels, coef, _, _ = _data(seed, vocab, vl * tp, dtype)
    sl = slice(rank * vl, (rank + 1) * vl)
    fp32 = dtype == torch.float32
    outs = []
    for temperature in (1.0, 0.6):
        ref = _reference(z, labels, coef, vocab, temperature)
        for chunk in CHUNKS:
            local = z[:, sl].clone().requires_grad_()
            with count_sweeps() as sweeps:
                lp, ent, lse = vocab_parallel_logprobs(
                    local, labels, group, temperature=temperature, chunk_size=chunk,
                    vocab_size=vocab, return_lse=True)
                (coef * torch.stack([lp, ent, lse])).sum().backward()
            tag = f"tp={tp} {dtype} tau={temperature} chunk={chunk}"
            n_chunks = 1 if chunk is None else math.ceil(T / chunk)
            has_cols = rank * vl < vocab
            assert sweeps.forward == sweeps.backward == n_chunks * has_cols, (tag, sweeps)
            assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (T,)
            assert local.grad.dtype == dtype
            _close(f"{tag} logprob", lp, ref[0], 1e-5 if fp32 else 1e-4)
            _close(f"{tag} entropy", ent, ref[1], 1e-5 if fp32 else 1e-4)
            _close(f"{tag} lse", lse, ref[2], 1e-5 if fp32 else 1e-4)
            assert bool((lp[labels == -100] == 0).all()), tag
            _close(f"{tag} grad", local.grad, ref[3][:, sl], 1e-5 if fp32 else 1e-4,
                   0.0 if fp32 else 8e-3)
            outs.append((lp.detach(), ent.detach(), local.grad))
    for a, b in zip(outs[0::2], outs[1::2]):  # chunked == unchunked
        for x, y in zip(a, b):
            _close(f"tp={tp} chunked vs unchunked", x, y, 1e-6)


def _check_hidden(group, rank: int, tp: int, vocab: int, vl: int, seed: int, dtype):
    """Tier 2 at one TP size: values and grads to hidden and to the local weight slice."""
    from megatron_maspo.parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden

    _, labels, coef, hidden, weight = _data(seed, vocab, vl * tp, dtype)
    coef = coef[:2]
    sl = slice(rank * vl, (rank + 1) * vl)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    x = (h64 @ w64.t())[:, :vocab] / 0.8
    logp_all = torch.log_softmax(x, dim=-1)
    ref_lp = logp_all.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1) * (labels != -100)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    (coef.double() * torch.stack([ref_lp, ref_ent])).sum().backward()
    # bf16: logits are rounded to bf16 by the GEMM (as Megatron's output layer does): ~|z|·2^-9.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for chunk in CHUNKS:
        h, w = hidden.clone().requires_grad_(), weight[sl].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_from_hidden(h, w, labels, group, temperature=0.8,
                                                      chunk_size=chunk, vocab_size=vocab)
        (coef * torch.stack([lp, ent])).sum().backward()
        tag = f"hidden tp={tp} {dtype} chunk={chunk}"
        _close(f"{tag} logprob", lp, ref_lp, tol)
        _close(f"{tag} entropy", ent, ref_ent, tol)
        rtol = 0.0 if dtype == torch.float32 else 5e-2
        _close(f"{tag} grad hidden", h.grad, h64.grad, tol, rtol)
        _close(f"{tag} grad weight", w.grad, w64.grad[sl], tol, rtol)
        if dtype == torch.bfloat16:  # same bf16 logits through Tier 1 give the same numbers
            z = (hidden @ w.detach().t()).contiguous()
            lp1, ent1 = vocab_parallel_logprobs(z, labels, group, temperature=0.8,
                                                chunk_size=chunk, vocab_size=vocab)
            _close(f"{tag} vs tier 1 logprob", lp, lp1, 1e-5)
            _close(f"{tag} vs tier 1 entropy", ent, ent1, 1e-5)


def _check_comm_bytes(group, rank: int, tp: int, vocab: int, vl: int):
    """Forward sends 16 B/token; Tier-1 backward sends nothing; Tier-2 backward only d_hidden."""
    import torch.distributed as dist

    from megatron_maspo.parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden

    sent = []
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, *a, **k)

    z, labels, _, hidden, weight = _data(3, vocab, vl * tp, torch.float32)
    sl = slice(rank * vl, (rank + 1) * vl)
    dist.all_reduce = counting
    try:
        local = z[:, sl].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(local, labels, group, chunk_size=4, vocab_size=vocab)
        fwd, sent[:] = sum(sent), []
        (lp.sum() + ent.sum()).backward()
        assert (fwd, sum(sent)) == (16 * T, 0), (fwd, sent)
        sent[:] = []
        h, w = hidden.clone().requires_grad_(), weight[sl].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_from_hidden(h, w, labels, group, chunk_size=4,
                                                      vocab_size=vocab)
        fwd, sent[:] = sum(sent), []
        (lp.sum() + ent.sum()).backward()
        assert (fwd, sum(sent)) == (16 * T, 4 * T * H), (fwd, sent)
    finally:
        dist.all_reduce = real


def _worker(rank: int, world: int, cases: list[tuple[int, int]]):
    """``cases``: (tp, vocab) pairs; ranks are split into consecutive groups of ``tp``."""
    import torch.distributed as dist

    with _parallel_state_forbidden():
        for tp, vocab in cases:
            groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
            group, grank = groups[rank // tp], rank % tp
            vl = -(-vocab // tp) + 1  # ceil + 1 padded row per rank: the padding is masked
            seed = 1000 * tp + rank // tp  # different data per group: the wrong group gives wrong sums
            for dtype in (torch.float32, torch.bfloat16):
                _check_logits(group, grank, tp, vocab, vl, seed, dtype)
                _check_hidden(group, grank, tp, vocab, vl, seed, dtype)
            _check_comm_bytes(group, grank, tp, vocab, vl)
        if world == 4:  # a whole rank of padding: rank 3 of [23 valid ids over 4 x 8] owns no valid id
            _check_logits(dist.group.WORLD, rank, 4, 23, 8, 7, torch.float32)
            _check_hidden(dist.group.WORLD, rank, 4, 23, 8, 7, torch.float32)
    return True


@pytest.mark.parametrize("world, cases", [
    (4, [(4, 37), (2, 37), (1, 37)]),
    (3, [(3, 50)]),
], ids=["tp4-tp2-tp1", "tp3-uneven"])
def test_vocab_parallel_logprobs_match_fp64_reference(world, cases):
    assert all(run_workers(_worker, world, cases, timeout_s=120))
