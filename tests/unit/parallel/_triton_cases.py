"""The interpreter cases of ``test_logprobs_triton.py``, run in a process of their own that starts with
``TRITON_INTERPRET=1`` (triton reads it when it is first imported, which in the test session has happened
long before). Prints one JSON object: each case's measured errors, or its exception."""

from __future__ import annotations

import json
import os
import sys
import traceback

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1 (tests/unit/parallel/test_logprobs_triton.py does)")

import torch  # noqa: E402

from megatron_maspo.parallel import logprobs_triton  # noqa: E402
from megatron_maspo.parallel.logprobs_hidden import (  # noqa: E402
    use_triton,
    vocab_parallel_logprobs_from_hidden,
)
from tests.distributed._launch import run_workers  # noqa: E402


def _inputs(tokens: int, hidden: int, rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Hidden states, a weight of ``rows`` rows (``vocab`` real, the rest padding) and labels with two
    masked positions; values rounded to ``dtype`` once, so the float64 reference sees the same inputs."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=g) * 0.6).to(dtype)
    w = (torch.randn(rows, hidden, generator=g) * 0.6).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[1] = labels[tokens // 2] = -100
    return h, w, labels


def _run(h, w, labels, dtype, kernel, *, temperature, vocab, chunk=None):
    hh = h.detach().clone().to(dtype).requires_grad_()
    ww = w.detach().clone().to(dtype).requires_grad_()
    lp, ent = vocab_parallel_logprobs_from_hidden(hh, ww, labels, temperature=temperature, vocab_size=vocab,
                                                  kernel=kernel, chunk_size=chunk)
    coeff = torch.linspace(-1.0, 1.0, labels.numel(), dtype=lp.dtype)
    (lp.sum() + (ent * coeff).sum()).backward()  # both outputs carry a gradient
    return [t.double() for t in (lp, ent, hh.grad, ww.grad)]


def _err(got, want):
    return [float((a - b).abs().max()) for a, b in zip(got, want)]


def fp32(temperature: float) -> dict:
    # V = 150 real rows of 157 (padding), 64-column tiles: a partial last tile; 37 tokens: a partial token
    # tile; backward in chunks of 16, 16, 5 tokens
    h, w, labels = _inputs(37, 48, 157, 150, torch.float32)
    ref = _run(h, w, labels, torch.float64, "torch", temperature=temperature, vocab=150)
    fused = _run(h, w, labels, torch.float32, "triton", temperature=temperature, vocab=150, chunk=16)
    plain = _run(h, w, labels, torch.float32, "torch", temperature=temperature, vocab=150, chunk=16)
    return {"vs_float64": _err(fused, ref), "vs_torch": _err(fused, plain),
            "padded_grad_max": float(fused[3][150:].abs().max()),
            "masked_logprob": [float(fused[0][1]), float(fused[0][37 // 2])],
            "entropy_min": float(fused[1].min())}


def bf16() -> dict:
    h, w, labels = _inputs(29, 40, 130, 130, torch.bfloat16, seed=1)
    ref = _run(h, w, labels, torch.float64, "torch", temperature=0.8, vocab=130)
    fused = _run(h, w, labels, torch.bfloat16, "triton", temperature=0.8, vocab=130, chunk=8)
    plain = _run(h, w, labels, torch.bfloat16, "torch", temperature=0.8, vocab=130, chunk=8)
    return {"vs_float64": _err(fused, ref), "torch_vs_float64": _err(plain, ref),
            "grad_scale": [float(ref[2].abs().max()), float(ref[3].abs().max())]}


def splits() -> dict:
    h, w, _ = _inputs(9, 16, 200, 200, torch.float32, seed=2)
    idx = torch.tensor([0, 5, 199, -1, 64, 63, 128, 127, 100])
    x = (h.double() @ w.double().t()) / 0.5
    m = x.amax(1)
    e = torch.exp(x - m[:, None])
    want = (m, e.sum(1), (e * (x - m[:, None])).sum(1),
            torch.where(idx >= 0, x.gather(1, idx.clamp(min=0)[:, None])[:, 0], 0.0))
    out = {}
    for n in (1, 4):
        got = logprobs_triton.merge_splits(logprobs_triton.fused_stats(h, w, idx, 0.5, splits=n))
        out[str(n)] = [float(((a.double() - b).abs() / (1 + b.abs())).max()) for a, b in zip(got, want)]
    return out


def choice() -> dict:
    h = torch.zeros(2, 4)
    out = {"auto": use_triton("auto", h), "torch": use_triton("torch", h), "triton": use_triton("triton", h)}
    for name, args in (("unknown", ("cuda", h)), ("fp64", ("triton", h.double()))):
        try:
            use_triton(*args)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _tp_worker(rank: int, world: int):
    import torch.distributed as dist  # the launcher made the gloo group

    h, w, labels = _inputs(21, 32, 160, 150, torch.float32, seed=3)  # 2 x 80 rows; rank 1 holds 10 padded
    part = w[rank * 80:(rank + 1) * 80].clone().requires_grad_()
    hh = h.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_from_hidden(hh, part, labels, dist.group.WORLD, temperature=0.9,
                                                  vocab_size=150, kernel="triton", chunk_size=8)
    (lp.sum() + (ent * torch.linspace(-1.0, 1.0, 21)).sum()).backward()
    return lp.detach(), ent.detach(), hh.grad, part.grad


def tp2() -> dict:
    h, w, labels = _inputs(21, 32, 160, 150, torch.float32, seed=3)
    ref = _run(h, w, labels, torch.float64, "torch", temperature=0.9, vocab=150)
    res = run_workers(_tp_worker, 2, fresh=True, timeout_s=300)
    dw = torch.cat([r[3] for r in res])
    return {"ranks": [_err([lp, ent, dh], ref[:3]) for lp, ent, dh, _ in res],
            "d_weight": float((dw.double() - ref[3]).abs().max())}


CASES = {"fp32_t1": lambda: fp32(1.0), "fp32_t07": lambda: fp32(0.7), "bf16": bf16, "splits": splits,
         "choice": choice, "tp2": tp2}

if __name__ == "__main__":
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 -- reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
    json.dump(results, sys.stdout)
