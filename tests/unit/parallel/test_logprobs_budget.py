"""The log-prob chunk is chosen from a byte budget, and a call never holds more workspace than it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_maspo.parallel.logprobs_budget import (
    CPU_BLOCK_BYTES,
    DEFAULT_BUDGET_BYTES,
    MIB,
    default_budget,
    plan_chunks,
)

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # plan_chunks only reads .type


@pytest.mark.parametrize("device", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("tile", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("elt", [2, 4])
def test_workspace_within_budget(device, tile, elt):
    for tokens in (1, 7, 2048, 65536):
        for n in (1, 100, 16384, 151936):
            for budget in (2 * MIB, 64 * MIB, 256 * MIB, 3 * 2**30):
                p = plan_chunks(tokens, n, elt, device, tile=tile, budget_bytes=budget)
                assert 1 <= p.block <= p.chunk <= tokens, (tokens, n, budget, p)
                assert p.workspace_bytes <= budget, (tokens, n, budget, p)
                # the budget is used: one more row per chunk would not fit (unless T is the limit)
                row = n * ((elt if tile else 0) + 8)
                if p.chunk < tokens and device.type != "cpu":
                    assert p.workspace_bytes + row > budget, (tokens, n, budget, p)
                if device.type == "cpu":
                    assert p.block * n * 4 <= max(CPU_BLOCK_BYTES, n * 4)  # fp32 block in cache


def test_chunk_follows_bytes_not_tokens():
    # twice the vocabulary slice -> half the tokens per chunk, same bytes
    a = plan_chunks(65536, 16384, 2, GPU, tile=True, budget_bytes=256 * MIB)
    b = plan_chunks(65536, 32768, 2, GPU, tile=True, budget_bytes=256 * MIB)
    assert a.chunk == 2 * b.chunk
    assert a.chunk == 256 * MIB // (16384 * 10)
    # GPU default: 256 MiB; the Qwen2.5-7B head at TP 1 gets 176 bf16 tokens per chunk
    assert plan_chunks(65536, 152064, 2, GPU, tile=True).chunk == 256 * MIB // (152064 * 10)
    assert default_budget(GPU) == DEFAULT_BUDGET_BYTES["cuda"] == 256 * MIB
    assert default_budget(CPU) == DEFAULT_BUDGET_BYTES["cpu"]


def test_explicit_chunk_size_overrides_the_budget():
    p = plan_chunks(1000, 64, 4, GPU, tile=True, budget_bytes=1, chunk_size=300)
    assert (p.chunk, p.block) == (300, 300)
    p = plan_chunks(1000, 16384, 4, CPU, tile=False, chunk_size=300)
    assert p.chunk == 300 and p.block == CPU_BLOCK_BYTES // (16384 * 4)


def test_budget_below_one_row_uses_one_row_and_warns(caplog):
    with caplog.at_level(logging.WARNING):
        p = plan_chunks(10, 151936, 2, GPU, tile=True, budget_bytes=1024)
    assert (p.chunk, p.block) == (1, 1)
    assert "below one token row" in caplog.text


@pytest.mark.parametrize("kw", [{"chunk_size": 0}, {"budget_bytes": -1}, {"budget_bytes": 1.5},
                                {"chunk_size": True}])
def test_bad_arguments_raise(kw):
    with pytest.raises(ValueError, match="positive int"):
        plan_chunks(10, 10, 4, CPU, tile=False, **kw)


_PROBE = textwrap.dedent("""
    import json, sys, torch
    from megatron_maspo.parallel import (vocab_parallel_logprobs,
                                         vocab_parallel_logprobs_from_hidden)
    torch.set_num_threads(1)
    budget, T, n, H = 8 << 20, 4096, 8192, 64

    def kb(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field))

    def extra(fn):  # peak extra KiB over the RSS before the call (inputs already resident)
        fn()  # warm-up: allocator and kernels
        rss = kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fn()
        return (kb("VmHWM") - rss) * 1024

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(T, H, generator=g), torch.randn(n, H, generator=g) * 0.3
    z, y = torch.randn(T, n, generator=g) * 3, torch.randint(0, n, (T,), generator=g)
    out = {}
    with torch.no_grad():
        out["hidden_fwd"] = extra(lambda: vocab_parallel_logprobs_from_hidden(
            h, w, y, chunk_bytes=budget))
        out["logits_fwd"] = extra(lambda: vocab_parallel_logprobs(z, y, chunk_bytes=budget))
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd_bwd():
        lp, ent = vocab_parallel_logprobs_from_hidden(hg, wg, y, chunk_bytes=budget)
        torch.autograd.grad((lp + ent).sum(), (hg, wg))

    out["hidden_fwd_bwd"] = extra(fwd_bwd)
    print(json.dumps(out))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux VmHWM reset")
def test_a_default_call_holds_no_more_than_the_budget():
    """Measured peak RSS of real calls (T=4096, V=8192: 128 MiB of fp32 logits) under an 8 MiB
    budget: forward holds the budget plus O(T) statistics; fwd+bwd adds only the two gradients."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    budget, slack = 8 * MIB, 1 * MIB  # slack: [T] statistics (~10 x 16 KiB), labels, allocator
    assert got["hidden_fwd"] <= budget + slack, got
    assert got["logits_fwd"] <= budget + slack, got
    grads = (4096 * 64 + 8192 * 64) * 4
    assert got["hidden_fwd_bwd"] <= budget + grads + slack, got
    # and the budget is what bounds it: the logits would be 16x larger
    assert got["hidden_fwd"] < 4096 * 8192 * 4 / 8


@pytest.mark.parametrize("t,c", [(2048, 992), (10, 5), (3, 7), (7, 3), (1, 1)])
def test_chunk_bounds_cover_tokens_remainder_first(t, c):
    from megatron_maspo.parallel.logprobs_budget import chunk_bounds

    b = chunk_bounds(t, c)
    assert b[0][0] == 0 and b[-1][1] == t
    assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
    assert all(0 < s1 - s0 <= c for s0, s1 in b)
    assert b[-1][1] - b[-1][0] == min(c, t)  # the kept (last) chunk is a full one
    assert all(s1 - s0 == c for s0, s1 in b[1:])


@pytest.mark.parametrize("budget", [None, 3000, 1])  # one chunk (tile kept), several, one row each
def test_kept_tile_backward_equals_recompute_and_survives_a_second_backward(budget):
    """The tile kept from the forward is overwritten by backward; a second backward recomputes."""
    from megatron_maspo.parallel import vocab_parallel_logprobs_from_hidden

    g = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 37, (13,), generator=g)
    coef = torch.randn(2, 13, generator=g, dtype=torch.float64)

    def grads(**kw):
        lp, ent = vocab_parallel_logprobs_from_hidden(h, w, y, vocab_size=37, temperature=0.8, **kw)
        loss = (coef[0] * lp + coef[1] * ent).sum()
        first = torch.autograd.grad(loss, (h, w), retain_graph=True)
        return first, torch.autograd.grad(loss, (h, w))

    ref, _ = grads(chunk_size=1)  # every chunk recomputed except a one-row tile
    first, second = grads(chunk_bytes=budget)
    for a, b, r in zip(first, second, ref):
        assert torch.allclose(a, r, atol=1e-12) and torch.allclose(b, r, atol=1e-12)
