"""Benchmark vocab-parallel log-prob + entropy against a naive full-gather baseline (targets C1-C8).

Runs, on ``--tp`` spawned gloo ranks with one thread each, the chunked paths of
``megatron_maspo.parallel.logprobs`` and a naive baseline (all-gather the full vocabulary, fp32
log-softmax, target gather, entropy over the full vocabulary, autograd backward, slice the gradient)
on the same seeded random inputs, interleaved per repetition (performance-model.md §6). Reports medians
over ``--reps`` after ``--warmup`` rounds and ratios candidate ÷ naive:

* peak extra memory per rank (VmHWM after the call, reset through /proc/self/clear_refs, minus VmRSS
  before it; inputs excluded): fwd+bwd from logits (C1), forward only (C2), from hidden (C3) and
  forward-only growth when N doubles (C4);
* wall time (max over ranks) fwd+bwd (C5) and forward only (C6);
* collective bytes per token per rank (C7), counted by wrapping ``all_reduce``/``all_gather``
  (all-reduce: tensor bytes; all-gather: bytes received from the other ranks);
* full-vocab sweeps per chunk (C8) from the implementation's counter.

    OMP_NUM_THREADS=1 python scripts/bench_logprobs.py               # performance-model.md §5 shapes
    OMP_NUM_THREADS=1 python scripts/bench_logprobs.py --quick --json /tmp/lp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# Fixed mmap threshold: large tensors are mmapped and returned to the OS on free, so RSS (and the
# high-water mark) track live tensors instead of glibc's retained heap (set before spawning ranks).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))

BYTES = {"on": False, "fwd": 0, "bwd": 0, "phase": "fwd"}


def _count(name: str, fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        if BYTES["on"]:
            if name == "all_reduce":
                n = args[0].numel() * args[0].element_size()
            else:  # all_gather(list, t) / all_gather_into_tensor(out, t): received from others
                t = args[1]
                n = t.numel() * t.element_size() * (dist.get_world_size(kwargs.get("group")) - 1)
            BYTES[BYTES["phase"]] += n
        return fn(*args, **kwargs)

    return wrapped


def _mem_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _naive_core(local: torch.Tensor, labels, coef, vocab: int, temperature: float, grad: bool):
    """All-gather [N, V/t] -> [N, V], log-softmax + entropy over V; return local-shard grad."""
    t = dist.get_world_size()
    out = torch.empty(t * local.shape[0], local.shape[1], dtype=local.dtype)
    dist.all_gather_into_tensor(out, local.detach().contiguous())
    full = out.view(t, *local.shape).permute(1, 0, 2).reshape(local.shape[0], -1)
    del out
    with torch.enable_grad() if grad else torch.no_grad():
        full.requires_grad_(grad)
        logp = torch.log_softmax(full[:, :vocab].float() / temperature, dim=-1)
        lp = logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1) * (labels != -100)
        ent = -(logp.exp() * logp).sum(-1)
        if not grad:
            return lp, ent, None
        BYTES["phase"] = "bwd"
        (g,) = torch.autograd.grad((coef[0] * lp + coef[1] * ent).sum(), full)
    r = dist.get_rank()
    return lp, ent, g[:, r * local.shape[1]:(r + 1) * local.shape[1]].contiguous()


def _variants(cfg: dict) -> dict[str, Callable]:
    from megatron_maspo.parallel import vocab_parallel_logprobs as vpl
    from megatron_maspo.parallel import vocab_parallel_logprobs_from_hidden as vplh

    group, vocab, tau, chunk = dist.group.WORLD, cfg["vocab"], cfg["temperature"], cfg["chunk"]

    def cand(x, grad):
        z = x["z"].requires_grad_(grad)
        with torch.enable_grad() if grad else torch.no_grad():
            lp, ent = vpl(z, x["labels"], group, temperature=tau, chunk_size=chunk,
                          vocab_size=vocab)
            if not grad:
                return lp, ent, None
            BYTES["phase"] = "bwd"
            return lp, ent, torch.autograd.grad((x["coef"][0] * lp + x["coef"][1] * ent).sum(), z)

    def cand_h(x, grad=True):
        h, w = x["h"].requires_grad_(), x["w"].requires_grad_()
        lp, ent = vplh(h, w, x["labels"], group, temperature=tau, chunk_size=chunk,
                       vocab_size=vocab)
        BYTES["phase"] = "bwd"
        return lp, ent, torch.autograd.grad((x["coef"][0] * lp + x["coef"][1] * ent).sum(), (h, w))

    def naive_h(x, grad=True):
        h, w = x["h"].requires_grad_(), x["w"].requires_grad_()
        z = h @ w.t()
        lp, ent, dz = _naive_core(z, x["labels"], x["coef"], vocab, tau, True)
        dh, dw = torch.autograd.grad(z, (h, w), dz)
        dist.all_reduce(dh)
        return lp, ent, (dh, dw)

    return {
        "naive_fwd_bwd": lambda x: _naive_core(x["z"], x["labels"], x["coef"], vocab, tau, True),
        "cand_fwd_bwd": lambda x: cand(x, True),
        "naive_fwd": lambda x: _naive_core(x["z"], x["labels"], x["coef"], vocab, tau, False),
        "cand_fwd": lambda x: cand(x, False),
        "naive_hidden": naive_h,
        "cand_hidden": cand_h,
    }


def _inputs(cfg: dict, n: int, seed: int, hidden: bool) -> dict:
    rank, t = dist.get_rank(), dist.get_world_size()
    vl = cfg["V"] // t
    g = torch.Generator().manual_seed(seed)  # shared draws: labels and loss coefficients
    labels = torch.randint(0, cfg["vocab"], (n,), generator=g)
    labels[::17] = -100
    coef = torch.randn(2, n, generator=g)
    g.manual_seed(seed * 1000 + rank + 1)  # this rank's shard
    x = {"labels": labels, "coef": coef}
    if hidden:
        x["h"] = torch.randn(n, cfg["H"], generator=torch.Generator().manual_seed(seed))
        x["w"] = torch.randn(vl, cfg["H"], generator=g) * (3 / cfg["H"] ** 0.5)
    else:
        x["z"] = torch.randn(n, vl, generator=g) * 3
    return x


def _measure(fn: Callable, x: dict) -> tuple[float, float, dict, tuple]:
    gc.collect()
    dist.barrier()
    rss = _mem_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    BYTES.update(on=True, fwd=0, bwd=0, phase="fwd")
    t0 = time.perf_counter()
    out = fn(x)
    dt = time.perf_counter() - t0
    BYTES["on"] = False
    extra_mb = (_mem_kb("VmHWM") - rss) / 1024
    stats = torch.tensor([dt, extra_mb], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return stats[0].item(), stats[1].item(), {"fwd": BYTES["fwd"], "bwd": BYTES["bwd"]}, out


def _gate(name: str, cand: tuple, naive: tuple) -> float:
    """Max abs difference of (log-prob, entropy, grads) candidate vs naive (correctness gate)."""
    a = [cand[0], cand[1], *(cand[2] if isinstance(cand[2], tuple) else [cand[2]])]
    b = [naive[0], naive[1], *(naive[2] if isinstance(naive[2], tuple) else [naive[2]])]
    return max((p - q).abs().max().item() for p, q in zip(a, b) if p is not None)


def _ref64(full: torch.Tensor, labels: torch.Tensor, vocab: int, tau: float):
    logp = torch.log_softmax(full[:, :vocab] / tau, dim=-1)
    lp = logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1) * (labels != -100)
    return lp, -(logp.exp() * logp).sum(-1)


def _fp64_gate(cfg: dict, var: dict, rows: int = 256) -> dict[str, float]:
    """Candidates vs a float64 full-vocabulary reference (performance-model.md §5), in row chunks.

    Returns max abs errors of log-prob / entropy and max relative (to the reference's max |g|)
    errors of every gradient, for the logits path and the from-hidden path.
    """
    rank, t = dist.get_rank(), dist.get_world_size()
    n, vocab, tau, vl = cfg["N"], cfg["vocab"], cfg["temperature"], cfg["V"] // t
    x, xh = _inputs(cfg, n, 0, False), _inputs(cfg, n, 0, True)
    lp, ent, (gz,) = var["cand_fwd_bwd"](x)
    hlp, hent, (gh, gw) = var["cand_hidden"](xh)
    w_full = torch.empty(t * vl, cfg["H"])
    dist.all_gather_into_tensor(w_full, xh["w"].detach())
    w64 = w_full.double().requires_grad_()
    ref = {k: torch.empty(n, dtype=torch.float64) for k in ("lp", "ent", "hlp", "hent")}
    ref_gz = torch.empty(n, vl, dtype=torch.float64)
    ref_gh = torch.empty(n, cfg["H"], dtype=torch.float64)
    for r0 in range(0, n, rows):
        sl = slice(r0, min(r0 + rows, n))
        m = sl.stop - r0
        out = torch.empty(t * m, vl)
        dist.all_gather_into_tensor(out, x["z"][sl].detach().contiguous())
        full = out.view(t, m, vl).permute(1, 0, 2).reshape(m, -1).double().requires_grad_()
        r = _ref64(full, x["labels"][sl], vocab, tau)
        ref["lp"][sl], ref["ent"][sl] = r[0].detach(), r[1].detach()
        (x["coef"][0, sl] * r[0] + x["coef"][1, sl] * r[1]).sum().backward()
        ref_gz[sl] = full.grad[:, rank * vl:(rank + 1) * vl]
        h64 = xh["h"][sl].detach().double().requires_grad_()
        z64 = h64 @ w64.t()
        # Values from the fp32 GEMM every fp32 implementation shares (its rounding is ~1e-5 at H=256
        # and is not the reduction's error); gradients through the exact float64 product.
        z32 = (xh["h"][sl].detach() @ w_full.t()).double()
        r = _ref64(z32 + (z64 - z64.detach()), xh["labels"][sl], vocab, tau)
        ref["hlp"][sl], ref["hent"][sl] = r[0].detach(), r[1].detach()
        (xh["coef"][0, sl] * r[0] + xh["coef"][1, sl] * r[1]).sum().backward()
        ref_gh[sl] = h64.grad
    ref_gw = w64.grad[rank * vl:(rank + 1) * vl]

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errs = torch.tensor([
        (lp - ref["lp"]).abs().max().item(), (ent - ref["ent"]).abs().max().item(), rel(gz, ref_gz),
        (hlp - ref["hlp"]).abs().max().item(), (hent - ref["hent"]).abs().max().item(),
        rel(gh, ref_gh), rel(gw, ref_gw)], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    keys = ("logprob_abs", "entropy_abs", "grad_logits_rel", "hidden_logprob_abs",
            "hidden_entropy_abs", "grad_hidden_rel", "grad_weight_rel")
    return dict(zip(keys, errs.tolist(), strict=True))


def _worker(rank: int, world: int, cfg: dict) -> dict:
    from megatron_maspo.parallel.logprobs import count_sweeps

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor"):
        setattr(dist, name, _count(name, getattr(dist, name)))
    var = _variants(cfg)
    n = cfg["N"]
    rec: dict[str, dict[str, list]] = {k: {"time": [], "mem": [], "bytes": []} for k in var}
    rec.update({f"{k}_2n": {"time": [], "mem": [], "bytes": []} for k in ("naive_fwd", "cand_fwd")})
    gates: dict[str, float] = {}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        xs = {False: _inputs(cfg, n, rep, False), True: _inputs(cfg, n, rep, True)}
        outs = {}
        for name, fn in var.items():
            dt, mb, by, outs[name] = _measure(fn, xs["hidden" in name])
            if rep >= cfg["warmup"]:
                for key, val in (("time", dt), ("mem", mb), ("bytes", by)):
                    rec[name][key].append(val)
        for kind in ("fwd_bwd", "fwd", "hidden"):
            diff = _gate(kind, outs[f"cand_{kind}"], outs[f"naive_{kind}"])
            gates[kind] = max(gates.get(kind, 0.0), diff)
        del outs, xs
        if rep >= cfg["warmup"] - 1:  # C4: forward-only memory at 2N (memory only, after warm-up)
            x2 = _inputs(cfg, 2 * n, rep, False)
            for name in ("naive_fwd", "cand_fwd"):
                dt, mb, by, _ = _measure(var[name], x2)
                rec[f"{name}_2n"]["mem"].append(mb)
            del x2
    with count_sweeps() as sweeps:
        var["cand_fwd_bwd"](_inputs(cfg, n, 0, False))
    chunks = -(-n // cfg["chunk"])
    return {"rec": rec, "gates": gates, "fp64_gate": _fp64_gate(cfg, var),
            "sweeps_per_chunk": (sweeps.forward / chunks, sweeps.backward / chunks)}


def _summarise(res: dict, cfg: dict) -> dict:
    med = {k: {m: statistics.median(v[m]) if v[m] else None for m in ("time", "mem")}
           for k, v in res["rec"].items()}
    n = cfg["N"]

    def per_tok(name, phase):
        return statistics.median(b[phase] for b in res["rec"][name]["bytes"]) / n

    def ratio(a, b, m):
        return med[a][m] / med[b][m]

    spread = {k: (min(v["time"]), max(v["time"])) for k, v in res["rec"].items() if v["time"]}
    out = {
        "C1_mem_fwd_bwd": ratio("cand_fwd_bwd", "naive_fwd_bwd", "mem"),
        "C2_mem_fwd": ratio("cand_fwd", "naive_fwd", "mem"),
        "C3_mem_hidden": ratio("cand_hidden", "naive_hidden", "mem"),
        "C3_mem_hidden_vs_naive_logits": ratio("cand_hidden", "naive_fwd_bwd", "mem"),
        "C4_growth_cand": ratio("cand_fwd_2n", "cand_fwd", "mem"),
        "C4_growth_naive": ratio("naive_fwd_2n", "naive_fwd", "mem"),
        "C5_time_fwd_bwd": ratio("cand_fwd_bwd", "naive_fwd_bwd", "time"),
        "C6_time_fwd": ratio("cand_fwd", "naive_fwd", "time"),
        "time_hidden": ratio("cand_hidden", "naive_hidden", "time"),
        "C7_bytes_per_token": {k: {"fwd": per_tok(k, "fwd"), "bwd": per_tok(k, "bwd")}
                               for k in ("cand_fwd_bwd", "naive_fwd_bwd", "cand_hidden",
                                         "naive_hidden")},
        "C8_sweeps_per_chunk_fwd_bwd": res["sweeps_per_chunk"],
        "gate_fp64_max_err": res["fp64_gate"],
        "cand_vs_naive_fp32_max_abs_diff": res["gates"],
        "medians": med, "time_spread_s": spread,
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", "-N", type=int, default=2048)
    p.add_argument("--vocab", "-V", type=int, default=32768,
                   help="padded vocabulary (divisible by tp)")
    p.add_argument("--pad", type=int, default=13, help="padded rows: true vocab_size = V - pad")
    p.add_argument("--hidden", "-H", type=int, default=256)
    p.add_argument("--chunk", "-C", type=int, default=256)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true",
                   help="smoke: N=256, V=4096, H=64, C=64, 1+2 reps")
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.vocab, a.hidden, a.chunk, a.warmup, a.reps = 256, 4096, 64, 64, 1, 2
    if a.vocab % a.tp:
        raise ValueError(f"--vocab {a.vocab} must divide by --tp {a.tp}")
    cfg = {"N": a.tokens, "V": a.vocab, "vocab": a.vocab - a.pad, "H": a.hidden, "chunk": a.chunk,
           "temperature": a.temperature, "warmup": a.warmup, "reps": a.reps}
    from megatron_maspo.parallel.launch import run_workers

    res = run_workers(_worker, a.tp, cfg, timeout_s=1800)[0]
    out = {"config": {**cfg, "tp": a.tp, "threads_per_rank": 1, "torch": torch.__version__},
           **_summarise(res, cfg)}
    _print(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _print(o: dict) -> None:
    c = o["config"]
    print(f"N={c['N']} V={c['V']} (vocab_size {c['vocab']}) H={c['H']} C={c['chunk']} t={c['tp']} "
          f"reps={c['reps']} torch {c['torch']}")
    print(f"{'variant':<16}{'time s':>10}{'extra MB':>12}")
    for k, v in o["medians"].items():
        t = "-" if v["time"] is None else f"{v['time']:.3f}"
        print(f"{k:<16}{t:>10}{v['mem']:>12.1f}")
    for k in ("C1_mem_fwd_bwd", "C2_mem_fwd", "C3_mem_hidden", "C3_mem_hidden_vs_naive_logits",
              "C4_growth_cand", "C4_growth_naive", "C5_time_fwd_bwd", "C6_time_fwd", "time_hidden"):
        print(f"{k:<32}{o[k]:.3f}")
    for k, v in o["C7_bytes_per_token"].items():
        print(f"C7 bytes/token {k:<16} fwd {v['fwd']:>9.1f}  bwd {v['bwd']:>9.1f}")
    print(f"C8 sweeps per chunk (fwd, bwd): {o['C8_sweeps_per_chunk_fwd_bwd']}")
    print(f"vs naive fp32, max |cand - naive|: {o['cand_vs_naive_fp32_max_abs_diff']}")
    g = o["gate_fp64_max_err"]
    ok = all(v <= 1e-5 for v in g.values())
    print(f"correctness gate vs float64 (all <= 1e-5: {'PASS' if ok else 'FAIL'}): "
          + ", ".join(f"{k} {v:.1e}" for k, v in g.items()))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
