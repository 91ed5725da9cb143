"""Recompute vs store in the fused LM-head log-prob pass: CPU time against the workspace budget.

One process, one thread, fp32, T x H hidden states and a V x H weight (one rank's slice). For each
byte budget, ``vocab_parallel_logprobs_from_hidden`` fwd+bwd keeps the last chunk's logits tile for
backward and recomputes the others (``parallel/logprobs_hidden.py``): a budget that holds all T
tokens recomputes nothing (3 GEMMs), a small one recomputes almost everything (4 GEMMs). The
reference row is one ``[T, H] x [H, V]`` GEMM. Interleaved repetitions, median process CPU time.

    OMP_NUM_THREADS=1 python scripts/bench_recompute_vs_store.py     # T 2048, V 16384, H 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> dict[str, float]:
    from megatron_maspo.parallel import vocab_parallel_logprobs_from_hidden
    from megatron_maspo.parallel.logprobs_budget import MIB, plan_chunks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", "-T", type=int, default=2048)
    p.add_argument("--vocab", "-V", type=int, default=16384, help="this rank's vocabulary slice")
    p.add_argument("--hidden", "-H", type=int, default=256)
    p.add_argument("--budgets-mib", type=int, nargs="+", default=[8, 32, 64, 96, 160])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g)
    w = torch.randn(a.vocab, a.hidden, generator=g) * (3 / a.hidden**0.5)
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    coef = torch.randn(2, a.tokens, generator=g)

    def fused(budget: int) -> None:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_from_hidden(hh, ww, y, chunk_bytes=budget)
        torch.autograd.grad((coef[0] * lp + coef[1] * ent).sum(), (hh, ww))

    runs = {"1 GEMM [T,H]x[H,V]": lambda: h @ w.t()}
    for mib in a.budgets_mib:
        runs[f"fwd+bwd, budget {mib} MiB"] = lambda b=mib * MIB: fused(b)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(a.reps + 1):
        for k, fn in runs.items():
            t0 = time.process_time()
            fn()
            if rep:  # the first round is a warm-up
                times[k].append(time.process_time() - t0)
    gemm = statistics.median(times["1 GEMM [T,H]x[H,V]"])
    print(f"T={a.tokens} V={a.vocab} H={a.hidden} fp32, 1 thread, median of {a.reps}")
    print(f"{'run':<28}{'chunk':>7}{'recomputed':>12}{'cpu s':>8}{'/ GEMM':>8}")
    out = {}
    for k, v in times.items():
        med = statistics.median(v)
        out[k] = med
        if k.startswith("fwd"):
            mib = int(k.split()[2])
            c = plan_chunks(a.tokens, a.vocab, 4, torch.device("cpu"), tile=True,
                            budget_bytes=mib * MIB).chunk
            rec = f"{(a.tokens - c) / a.tokens:.0%}" if c < a.tokens else "0%"
            print(f"{k:<28}{c:>7}{rec:>12}{med:>8.3f}{med / gemm:>8.2f}")
        else:
            print(f"{k:<28}{'':>7}{'':>12}{med:>8.3f}{1:>8.2f}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
