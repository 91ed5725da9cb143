"""Python parts of ``scripts/gpu_smoke.sh`` (one subcommand per part; each prints one ``SMOKE`` line).

    python scripts/gpu_smoke.py nccl [--cpu]            1-rank NCCL group: CUDA all-reduce works, a CPU
                                                        tensor is refused loudly (gloo with --cpu)
    python scripts/gpu_smoke.py make-hf OUT [--family F]
                                                        a tiny random HF folder (fp32; Qwen2 unless F) to
                                                        convert
    python scripts/gpu_smoke.py check-train RUN --steps N [--cpu]
                                                        metrics.jsonl of a smoke training run: N steps,
                                                        finite loss and non-zero grad norm every step,
                                                        memory/* for every phase
    python scripts/gpu_smoke.py check-train RUN --steps N --pools [--cpu]
                                                        the same for a disaggregated run (the training
                                                        pool's metrics): finite loss, gradient norm and
                                                        reward, bytes synced every step
    python scripts/gpu_smoke.py check-verify LOG --tol T
                                                        the ``verify:`` figure of a convert --verify log
                                                        is at most T
    python scripts/gpu_smoke.py logprobs [--cpu]        vocab-parallel log-probs + entropy (logits given
                                                        and from hidden) vs a naive full log-softmax in
                                                        the same run: max error, time and peak-memory ratios
    python scripts/gpu_smoke.py varlen [--cpu]          attention_backend='varlen''s kernel call vs per-sequence
                                                        SDPA on a packed bf16 row (skipped with --cpu)

Exit status 0 = the part passed. ``--cpu`` runs the same code on CPU with gloo (fast shapes), so the
script's Python is tested without a GPU (tests/unit/scripts/test_gpu_smoke.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the parts that compute: the log checks start in 0.1 s
    import torch

PHASES = ("generate", "grade", "old_logprobs", "train", "sync")
POOL_PHASES = ("old_logprobs", "train", "sync")
"""The training pool's phases in a disaggregated run (generation and grading happen in the rollout pool)."""


def _device(cpu: bool) -> torch.device:
    import torch

    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --cpu for the CPU rehearsal)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device())


def _init_group(cpu: bool) -> None:
    import torch.distributed as dist

    from megatron_maspo.parallel.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)


def cmd_nccl(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    dev = _device(a.cpu)
    _init_group(a.cpu)
    t = torch.arange(4, dtype=torch.float32, device=dev)
    dist.all_reduce(t)
    ok = torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32))
    refused = "n/a (gloo accepts CPU tensors)"
    if not a.cpu:
        try:
            dist.all_reduce(torch.ones(1))  # a CPU control tensor on an NCCL-only group
            refused = "NO: a CPU tensor went through an NCCL group"
            ok = False
        except (RuntimeError, ValueError) as e:
            refused = f"yes ({str(e).splitlines()[0][:70]})"
    dist.destroy_process_group()
    print(f"SMOKE nccl: backend={'gloo' if a.cpu else 'nccl'} all_reduce={'ok' if ok else 'WRONG'} "
          f"cpu_tensor_refused={refused}")
    return 0 if ok else 1


def cmd_make_hf(a: argparse.Namespace) -> int:
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    make_tiny_hf_model(a.family, a.out, vocab_size=301, seed=0,
                       **({"num_hidden_layers": 2} if a.family == "qwen2" else {}))
    print(f"SMOKE make-hf: tiny {a.family} (fp32) in {a.out}")
    return 0


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def cmd_check_train(a: argparse.Namespace) -> int:
    """A colocated run: finite loss and a non-zero gradient every step, memory of every phase. ``--pools``
    (a disaggregated run, logged by the training pool): finite loss, gradient norm and reward every step,
    a weight sync that moved bytes over the bridge, memory of the training pool's phases."""
    recs = [json.loads(x) for x in (Path(a.run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    problems = []
    if len(recs) != a.steps:
        problems.append(f"{len(recs)} steps logged, expected {a.steps}")
    kinds = ["peak_rss", "rss"] + ([] if a.cpu else ["peak_alloc", "peak_reserved"])
    for r in recs:
        loss = r.get("actor/loss")
        if not _finite(loss):
            problems.append(f"step {r.get('step')}: actor/loss={loss}")
        gnorm = r.get("actor/grad_norm")
        # zero advantages (every reward of a group equal) give a zero gradient: nothing was trained. The
        # pools run checks that the job finishes with finite figures, so a zero gradient is allowed there.
        if not _finite(gnorm) or gnorm < 0 or (gnorm == 0 and not a.pools):
            problems.append(f"step {r.get('step')}: actor/grad_norm={gnorm}")
        if a.pools and not (_finite(r.get("reward/mean")) and (r.get("sync/gb_per_s") or 0) > 0):
            problems.append(f"step {r.get('step')}: reward/mean={r.get('reward/mean')} "
                            f"sync/gb_per_s={r.get('sync/gb_per_s')}")
        phases = POOL_PHASES if a.pools else PHASES
        missing = [f"{p}_{k}" for p in phases for k in kinds if f"memory/{p}_{k}_gb" not in r]
        if missing:
            problems.append(f"step {r.get('step')}: no memory/{missing[0]}_gb (+{len(missing) - 1})")
    if a.pools:
        return _report_pools(recs, problems)
    last = recs[-1] if recs else {}
    step_s = statistics.median(r["time/step"] for r in recs) if recs else float("nan")
    mem = "rss" if a.cpu else "peak_alloc"
    short = {"generate": "gen", "grade": "grade", "old_logprobs": "old_lp", "train": "train", "sync": "sync"}
    figs = " ".join(f"{short[p]}={last.get(f'memory/{p}_{mem}_gb', float('nan')):.2f}" for p in PHASES)
    print(f"SMOKE train: steps={len(recs)} step_s={step_s:.2f} "
          f"reward={last.get('reward/mean', float('nan')):.3f} loss={last.get('actor/loss', float('nan')):.4f} "
          f"gnorm(min)={min((r.get('actor/grad_norm') or 0.0) for r in recs) if recs else 0.0:.3g} "
          f"offload_gb={last.get('memory/offloaded_gb', 0.0):.3f} {mem}_gb[{figs}]"
          + ("" if not problems else " PROBLEMS: " + "; ".join(problems[:3])))
    return 0 if not problems else 1


def _report_pools(recs: list[dict], problems: list[str]) -> int:
    last = recs[-1] if recs else {}
    step_s = statistics.median(r["time/step"] for r in recs) if recs else float("nan")
    print(f"SMOKE disagg: steps={len(recs)} step_s={step_s:.2f} reward={last.get('reward/mean', float('nan')):.3f} "
          f"loss={last.get('actor/loss', float('nan')):.4f} gnorm={last.get('actor/grad_norm', float('nan')):.3g} "
          f"sync_gb_s={last.get('sync/gb_per_s', float('nan')):.3g}"
          + ("" if not problems else " PROBLEMS: " + "; ".join(problems[:3])))
    return 0 if not problems else 1


def cmd_check_verify(a: argparse.Namespace) -> int:
    """The ``verify: max relative logits error E`` line of a conversion log, held to ``--tol``."""
    lines = [x for x in Path(a.log).read_text().splitlines() if x.startswith("verify: ")]
    if not lines:
        print(f"SMOKE verify: no 'verify:' line in {a.log}")
        return 1
    err = float(lines[-1].split()[-1])
    ok = math.isfinite(err) and err <= a.tol
    print(f"SMOKE verify: max_rel_logits_err={err:.2e} tol={a.tol:.0e} {'ok' if ok else 'ABOVE TOLERANCE'}")
    return 0 if ok else 1


def _timed(fn, dev: torch.device, reps: int) -> tuple[float, float, object]:
    """(median seconds, peak extra GB over the inputs, last output) of ``fn()``."""
    import torch

    times, peak, out = [], 0.0, None
    for _ in range(reps):
        out = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = max(peak, (torch.cuda.max_memory_allocated(dev) - base) / 2**30)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak, out


def cmd_logprobs(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megatron_maspo.parallel import vocab_parallel_logprobs as vpl
    from megatron_maspo.parallel import vocab_parallel_logprobs_from_hidden as vplh

    dev = _device(a.cpu)
    _init_group(a.cpu)
    n, v, h = (256, 4096, 64) if a.cpu else (a.tokens, a.vocab, a.hidden)
    g = torch.Generator(device=dev).manual_seed(0)
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    z = torch.randn(n, v, device=dev, generator=g) * 3
    hid = torch.randn(n, h, device=dev, generator=g)
    w = torch.randn(v, h, device=dev, generator=g) / h**0.5
    group = dist.group.WORLD

    def naive(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)

    def run(kind: str, fused: bool):
        zz = z.detach().requires_grad_()
        hh, ww = hid.detach().requires_grad_(), w.detach().requires_grad_()
        if kind == "logits":
            lp, ent = vpl(zz, labels, group) if fused else naive(zz)
            (lp.sum() + ent.sum()).backward()
            return lp.detach(), ent.detach(), zz.grad
        lp, ent = vplh(hh, ww, labels, group) if fused else naive(hh @ ww.t())
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), ww.grad

    lines, ok = [], True
    for kind in ("logits", "hidden"):
        t_n, m_n, ref = _timed(functools.partial(run, kind, False), dev, a.reps)
        t_c, m_c, got = _timed(functools.partial(run, kind, True), dev, a.reps)
        err = max((x - y).abs().max().item() / max(y.abs().max().item(), 1e-12)
                  for x, y in zip(got, ref, strict=True))
        ok &= err < 1e-4
        mem = f" mem x{m_c / m_n:.2f}" if m_n > 0 else ""
        lines.append(f"{kind}: max_rel_err={err:.1e} time x{t_c / t_n:.2f}{mem}")
    dist.destroy_process_group()
    print(f"SMOKE logprobs: N={n} V={v} H={h} fwd+bwd vs naive log-softmax: "
          + "; ".join(lines))
    return 0 if ok else 1


def cmd_varlen(a: argparse.Namespace) -> int:
    """``model.attention_backend='varlen'``'s kernel call (``model/varlen_attention.varlen_call``) on a packed
    bf16 row of 7B-shaped heads vs one SDPA call per sequence (``packed_sdpa``'s path): error and time."""
    if a.cpu:
        print("SMOKE varlen: skipped with --cpu (torch's varlen kernel is CUDA only)")
        return 0
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.varlen import varlen_attn

    from megatron_maspo.model.varlen_attention import varlen_call

    dev = _device(False)
    lens, nh, ng, d = [700, 1500, 37, 4096, 1200, 2659], 28, 4, 128
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], h, d, device=dev, generator=g, dtype=torch.bfloat16) for h in (nh, ng, ng))
    cu = torch.tensor(bounds, device=dev, dtype=torch.int32)
    scale = d ** -0.5

    def per_sequence() -> torch.Tensor:
        outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                               scale=scale, enable_gqa=True)[0].transpose(0, 1)
                for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs)

    args, kw = varlen_call(q, k, v, cu, max(lens), scale=scale, causal=True, kernel=varlen_attn)
    t_ref, _, ref = _timed(per_sequence, dev, a.reps)
    t_var, _, got = _timed(lambda: varlen_attn(*args, **kw), dev, a.reps)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"SMOKE varlen: {len(lens)} sequences, {bounds[-1]} tokens, {nh}/{ng} heads x {d}: max_rel_err={err:.1e} "
          f"time x{t_var / t_ref:.2f} of per-sequence SDPA")
    return 0 if err < 2e-2 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("nccl")
    s.add_argument("--cpu", action="store_true")
    s = sub.add_parser("make-hf")
    s.add_argument("out")
    s.add_argument("--family", default="qwen2", help="a registered family with a tiny config (deepseek_v3: MLA)")
    s = sub.add_parser("check-train")
    s.add_argument("run")
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--cpu", action="store_true")
    s.add_argument("--pools", action="store_true", help="a disaggregated run (the training pool's metrics)")
    s = sub.add_parser("check-verify")
    s.add_argument("log")
    s.add_argument("--tol", type=float, required=True)
    s = sub.add_parser("logprobs")
    s.add_argument("--cpu", action="store_true")
    s.add_argument("--tokens", type=int, default=8192)
    s.add_argument("--vocab", type=int, default=152064)
    s.add_argument("--hidden", type=int, default=3584)
    s.add_argument("--reps", type=int, default=3)
    s = sub.add_parser("varlen")
    s.add_argument("--cpu", action="store_true")
    s.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    return {"nccl": cmd_nccl, "make-hf": cmd_make_hf, "check-train": cmd_check_train,
            "check-verify": cmd_check_verify, "logprobs": cmd_logprobs, "varlen": cmd_varlen}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
