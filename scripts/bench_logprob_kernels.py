"""The fused log-prob + entropy kernels side by side, in one process, on the same shapes: correctness first,
then time and peak memory, as ratios against baselines measured in the same run.

    python scripts/bench_logprob_kernels.py            # on a GPU: the 1.5B, 7B and 70B heads at N = 8192, bf16
    python scripts/bench_logprob_kernels.py --cpu      # rehearsal: one small shape, Triton's interpreter, fp32
    python scripts/bench_logprob_kernels.py --shapes 7b --reps 5

Rows (forward, then forward + backward; backward seeds both outputs):

    matmul      the LM-head GEMM alone (forward) / its three GEMMs (forward + backward): the floor
    naive       GEMM, full log-softmax and entropy in fp32, autograd
    torch       this project's torch chunk loop (train.logprob_kernel=torch)
    triton      this project's Triton kernels (train.logprob_kernel=triton)
    liger       Liger-Kernel 0.8.5's fused linear scaled cross-entropy with entropy (per-token log-prob and
                entropy, temperature; its sm90 kernel needs the ``cutedsl`` extra, else its chunk loop
                runs and the row is ``liger-loop``), if it imports
    cce         Apple's Cut Cross-Entropy (per-token log-prob only, exact gradients), if it imports

Each of ours is checked against float64 on a slice of the same inputs before anything is timed; a check
that fails ends the run with status 1 (the smoke's rule). Times are medians of ``--reps`` after one warm-up
(``torch.cuda.synchronize`` around each); memory is the peak allocated above the inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = {"1.5b": (1536, 151936), "7b": (3584, 152064), "70b": (8192, 128256)}
"""Head shapes (H, V) of Qwen2.5-1.5B, Qwen2.5-7B and Llama-3-70B."""


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="rehearsal on CPU (interpreter, small shape, fp32)")
    p.add_argument("--shapes", default="1.5b,7b,70b", help=f"comma-separated of {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    if a.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels
    import torch

    from megatron_maspo.parallel.logprobs_hidden import vocab_parallel_logprobs_from_hidden as fused

    dev = torch.device("cpu" if a.cpu else "cuda")
    dtype = torch.float32 if a.cpu else torch.bfloat16
    shapes = [(64, 24, 300)] if a.cpu else [(a.tokens, *SHAPES[s]) for s in a.shapes.split(",")]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def measure(fn, reps):
        fn()
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else 0
        return statistics.median(times), peak

    def ours(kernel):
        def run(h, w, y, backward):
            hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
            lp, ent = fused(hh, ww, y, kernel=kernel)
            if backward:
                (lp.sum() + ent.sum()).backward()
            return lp, ent
        return run

    def naive(h, w, y, backward):
        hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        logp = torch.log_softmax((hh @ ww.t()).float(), -1)
        lp, ent = logp.gather(1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        if backward:
            (lp.sum() + ent.sum()).backward()
        return lp, ent

    def matmuls(h, w, y, backward):
        z = h @ w.t()
        if backward:  # the two backward GEMMs of the same shapes
            z @ w
            z.t() @ h
        return z

    peers, notes = {}, []
    try:
        import liger_kernel.ops.fused_linear_scaled_cross_entropy as liger_scaled

        fallback = liger_scaled._FusedLinearPPOFallbackFunction
        try:
            impl = liger_scaled._resolve_implementation(dev)  # its fused kernel on sm90, else a chunk loop
        except ImportError as e:  # the sm90 kernel is in the `cutedsl` extra (nvidia-cutlass-dsl)
            impl = fallback
            notes.append(f"liger: its fused kernel needs {e.name} (extra 'cutedsl'): its torch chunk loop ran")
        label = "liger" if impl is not fallback else "liger-loop"

        def liger(h, w, y, backward, impl=impl):
            # per-token NLL and entropy with temperature: the peer that returns what ours does
            hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
            args = (hh, ww, y, 1.0, -100, 1, True) if impl is not fallback else (hh, ww, y, 1.0, -100, True)
            nll, ent = impl.apply(*args)
            if backward:
                (ent.sum() - nll.sum()).backward()
            return -nll, ent
        peers[label] = liger
    except ImportError as e:
        notes.append(f"liger: not installed ({e.name})")
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, w, y, backward):
            # log-prob only (no entropy); filter_eps=None: exact gradients, as ours
            hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
            nll = linear_cross_entropy(hh, ww, y, reduction="none", filter_eps=None)
            if backward:
                nll.sum().backward()
            return -nll, None
        peers["cce"] = cce
    except ImportError as e:
        notes.append(f"cce: not installed ({e.name})")
    for n in notes:
        print(n)

    status, summary = 0, []
    for n, hdim, v in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(n, hdim, device=dev, generator=g, dtype=torch.float32).to(dtype)
        w = (torch.randn(v, hdim, device=dev, generator=g, dtype=torch.float32) / hdim ** 0.5).to(dtype)
        y = torch.randint(0, v, (n,), device=dev, generator=g)
        # correctness on a slice, against float64 of the same (rounded) inputs
        k = min(n, 256)
        x64 = h[:k].double() @ w.double().t()
        logp = torch.log_softmax(x64, -1)
        ref = (logp.gather(1, y[:k, None])[:, 0], -(logp.exp() * logp).sum(-1))
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        for kernel in ("torch", "triton"):
            lp, ent = ours(kernel)(h[:k], w, y[:k], False)
            err = max(float((lp.double() - ref[0]).abs().max()), float((ent.double() - ref[1]).abs().max()))
            ok = err <= tol or (kernel == "torch" and dtype != torch.float32)  # the torch tile is bf16 logits
            print(f"check N={k} H={hdim} V={v} {kernel}: max error {err:.2e} (tol {tol:.0e}) "
                  f"{'ok' if ok else 'FAIL'}")
            if not ok:
                status = 1
        for name, fn in list(peers.items()):  # the peers are checked too; a peer that fails is dropped
            try:
                lp, ent = fn(h[:k], w, y[:k], False)
                err = max(float((lp.double() - ref[0]).abs().max()),
                          float((ent.double() - ref[1]).abs().max()) if ent is not None else 0.0)
                print(f"check N={k} H={hdim} V={v} {name}: max error {err:.2e}")
            except Exception as e:  # noqa: BLE001 (a peer's failure is reported, not ours)
                print(f"check {name}: {type(e).__name__}: {str(e)[:160]} (dropped)")
                del peers[name]
        if status:
            return status
        rows = {"matmul": matmuls, "naive": naive, "torch": ours("torch"), "triton": ours("triton"), **peers}
        shape_figs: list[str] = []
        for backward in (False, True):
            res = {}
            for name, fn in rows.items():
                try:
                    res[name] = measure(lambda fn=fn, bw=backward, hwy=(h, w, y): fn(*hwy, bw), 1 if a.cpu else a.reps)
                except torch.OutOfMemoryError:
                    res[name] = None
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            t0, m0 = res["matmul"]
            tn, mn = res["naive"] or (float("nan"), 1)
            what = "forward+backward" if backward else "forward"
            print(f"\n{what}, N={n} H={hdim} V={v} {str(dtype).split('.')[-1]} on {dev.type}")
            print(f"{'kernel':8} {'ms':>9} {'x matmul':>9} {'x naive':>8} {'peak MiB':>9} {'x naive mem':>11}")
            for name, r in res.items():
                if r is None:
                    print(f"{name:8} {'OOM':>9}")
                    continue
                t, m = r
                print(f"{name:8} {t * 1e3:9.2f} {t / t0:9.2f} {t / tn:8.2f} {m / 2**20:9.0f} "
                      f"{(m / mn if mn else float('nan')):11.2f}")
            tri = res.get("triton")
            if tri is not None:  # the summary row: time x the GEMM floor, x each peer; memory x naive
                figs = [f"{'fb' if backward else 'f'} {tri[0] / t0:.2f}x mm"]
                figs += [f"{p[:5]} {tri[0] / res[p][0]:.2f}x" for p in peers if res.get(p) is not None]
                if backward and mn and tri[1]:
                    figs.append(f"mem {tri[1] / mn:.2f}x")
                shape_figs.append(" ".join(figs))
        summary.append(f"H{hdim} " + ", ".join(shape_figs))
    print("SMOKE kernels: triton " + "; ".join(summary))
    return status


if __name__ == "__main__":
    sys.exit(main())
