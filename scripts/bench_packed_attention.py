"""Peak extra memory of one packed micro-batch, forward+backward: packed SDPA vs the dense block mask.

For each ``model.attention_backend`` (``dense_mask``, ``packed_sdpa``) and each row length (4,096 and
8,192 tokens by default) a fresh single-rank gloo process builds the same small GQA model, warms up
with one 256-token row (gradients and allocator in place), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), then runs the actor's pass on one packed row: forward to the final
hidden states, the fused hidden→log-prob pass at the response positions, a mean log-prob loss and
backward. ``extra`` = peak RSS during that step − RSS before it: every tensor the step needs,
including the dense path's ``[1, 1, S, S]`` mask and Megatron's ``[heads, S, S]`` score buffer.

The row packs sequences of unequal length (1,536 / 512 / 1,024 / 1,024 tokens, repeated), the second
half of each is its response. Doubling the row doubles the sequences: the packed path's memory is
linear in S, the dense path's attention term grows 4x.

``--cp N`` runs ``packed_sdpa`` with context parallelism over N gloo ranks instead: each rank holds
its two chunks of every sequence (the pattern's lengths divide by 2N) and the response positions it
predicts; the figure is the largest rank's extra peak.

Usage (Linux: needs /proc): ``OMP_NUM_THREADS=1 python scripts/bench_packed_attention.py
[--lengths 4096 8192] [--backends dense_mask packed_sdpa] [--layers 2] [--cp 2]``
"""

from __future__ import annotations

import argparse
import gc
import re
import time

import torch

from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.launch import run_workers

PATTERN = [1536, 512, 1024, 1024]  # sequence lengths, repeated to fill the row


def _spec(layers: int) -> ArchSpec:
    return ArchSpec(family="qwen2", num_layers=layers, hidden_size=128, ffn_hidden_size=384,
                    num_attention_heads=4, num_query_groups=2, kv_channels=32, vocab_size=1000,
                    max_position_embeddings=32768, add_qkv_bias=True, tie_word_embeddings=True)


def _kib(field: str) -> int:
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def row_lengths(total: int) -> list[int]:
    """Sequence lengths cycling through ``PATTERN`` that sum to ``total``."""
    out, k = [], 0
    while sum(out) < total:
        out.append(min(PATTERN[k % len(PATTERN)], total - sum(out)))
        k += 1
    return out


def _step(model, backend: str, lens: list[int], vocab: int, cp: int = 1, cp_rank: int = 0) -> None:
    """One forward+backward of the actor's pass on a packed row of sequences ``lens`` (at ``cp > 1``
    this CP rank's share of it)."""
    from megatron_maspo.model.packed_attention import build_packed_seq_params
    from megatron_maspo.parallel.context_parallel import cp_local_positions, cp_owner
    from megatron_maspo.parallel.logprobs import vocab_parallel_logprobs_from_hidden
    from megatron_maspo.train.actor.forward import hidden_output, output_weight
    from megatron_maspo.train.actor.packing import block_causal_mask, cu_seqlens

    g = torch.Generator().manual_seed(len(lens))
    s = sum(lens)
    ids = torch.randint(0, vocab, (1, s), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    bounds = cu_seqlens(lens)
    rows = torch.cat([torch.arange(a + (b - a) // 2 - 1, b - 1) for a, b in zip(bounds[:-1], bounds[1:])])
    labels = ids[0, rows + 1]
    if cp > 1:  # this rank's rows, and the response positions it predicts (at local rows)
        held = cp_local_positions(bounds, cp, cp_rank)
        owner, local = cp_owner(rows, bounds, cp)
        ids, pos, rows, labels = ids[:, held], pos[:, held], local[owner == cp_rank], labels[owner == cp_rank]
    with hidden_output([model]):
        if backend == "dense_mask":
            out = model(ids, pos, block_causal_mask(lens))
        else:
            out = model(ids, pos, None, packed_seq_params=build_packed_seq_params(bounds))
        lp, _ = vocab_parallel_logprobs_from_hidden(out[0].index_select(0, rows), output_weight(model),
                                                    labels, None, vocab_size=vocab)
        (-lp.mean()).backward()


def _worker(rank: int, world: int, backend: str, seq: int, layers: int) -> dict:
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel

    spec = _spec(layers)
    init_parallel(tp=1, pp=1, cp=world, seed=0)  # world > 1: every rank is one CP rank
    model = build_model_chunks(spec, ModelBuildOptions(attention_backend=backend, cp=world), pp_rank=0)[0]
    _step(model, backend, [128, 128], spec.vocab_size, world, rank)  # warm-up: grads, kernels
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    _step(model, backend, row_lengths(seq), spec.vocab_size, world, rank)
    dt = time.perf_counter() - t0
    return {"extra_mib": (_kib("VmHWM") - base) / 1024, "seconds": dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--backends", nargs="+", default=["dense_mask", "packed_sdpa"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (packed_sdpa only)")
    args = ap.parse_args()
    if args.cp > 1 and args.backends != ["packed_sdpa"]:
        args.backends = ["packed_sdpa"]  # the dense mask does not split over CP ranks

    def worst(rows: list[dict]) -> dict:
        return max(rows, key=lambda r: r["extra_mib"])

    res = {(b, s): worst(run_workers(_worker, args.cp, b, s, args.layers)) for b in args.backends
           for s in args.lengths}
    print(f"model: {args.layers} layers, hidden 128, 4 heads / 2 KV groups x 32, fp32, cp={args.cp} "
          f"(largest rank); row = sequences of {PATTERN} tokens repeated")
    head = "| backend | " + " | ".join(f"S={s:,}: extra MiB (s)" for s in args.lengths)
    print(head + f" | growth x{args.lengths[-1] / args.lengths[0]:g} length |")
    print("|" + "---|" * (len(args.lengths) + 2))
    for b in args.backends:
        cells = [f"{res[b, s]['extra_mib']:.0f} ({res[b, s]['seconds']:.1f})" for s in args.lengths]
        growth = res[b, args.lengths[-1]]["extra_mib"] / res[b, args.lengths[0]]["extra_mib"]
        print(f"| {b} | " + " | ".join(cells) + f" | {growth:.2f}x |")


if __name__ == "__main__":
    main()
