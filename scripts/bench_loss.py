"""Cost of the policy loss relative to the log-prob pass on the same tokens (target: < 5%).

Baseline: fp32 ``log_softmax`` + ``gather`` over ``[N, V]`` logits, forward + backward. Measured:
``compute_policy_loss`` (MASPO, token-mean, full metrics) forward + backward on the same N tokens.
Reps are interleaved so machine noise hits both alike; the median per-rep ratio is reported.

    OMP_NUM_THREADS=1 python scripts/bench_loss.py                 # N=4096, V=32768
    python scripts/bench_loss.py --reps 9 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_maspo.loss import LossConfig, LossInputs, compute_policy_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _logprob_pass(logits: torch.Tensor, labels: torch.Tensor) -> float:
    x = logits.detach().requires_grad_()
    _sync(x.device)
    t0 = time.perf_counter()
    lp = torch.log_softmax(x.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    lp.sum().backward()
    _sync(x.device)
    return time.perf_counter() - t0


def _loss_pass(cfg: LossConfig, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
               mask: torch.Tensor) -> float:
    x = logp.detach().requires_grad_()
    _sync(x.device)
    t0 = time.perf_counter()
    loss, metrics = compute_policy_loss(cfg, LossInputs(
        logprobs=x, old_logprobs=old, advantages=adv, mask=mask,
        num_tokens_global=int(mask.numel())))
    loss.backward()
    # Metrics are part of the cost: materialise them (one stack, as the trainer's reduce does).
    torch.stack([v.to(x.device) for v in metrics.values()]).sum().item()
    _sync(x.device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096, help="tokens N")
    ap.add_argument("--v", type=int, default=32768, help="vocabulary V")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.n, args.v, generator=g).to(dev)
    labels = torch.randint(0, args.v, (args.n,), generator=g).to(dev)
    old = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    logp = old + 0.1 * torch.randn(args.n, generator=g).to(dev)
    adv = torch.randn(args.n, generator=g).to(dev)
    mask = torch.ones(args.n, dtype=torch.bool, device=dev)
    cfg = LossConfig(method="maspo")
    _logprob_pass(logits, labels), _loss_pass(cfg, logp, old, adv, mask)  # warm-up
    base, loss, ratios = [], [], []
    for _ in range(args.reps):
        b = _logprob_pass(logits, labels)
        c = _loss_pass(cfg, logp, old, adv, mask)
        base.append(b), loss.append(c), ratios.append(c / b)
    res = {"device": args.device, "n": args.n, "v": args.v, "reps": args.reps, "threads": args.threads,
           "logprob_pass_ms_median": 1e3 * statistics.median(base),
           "loss_ms_median": 1e3 * statistics.median(loss),
           "ratio_median": statistics.median(ratios)}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"log-prob pass (fp32 log_softmax+gather fwd+bwd, N={args.n}, V={args.v}): "
              f"{res['logprob_pass_ms_median']:.1f} ms")
        print(f"compute_policy_loss (MASPO, fwd+bwd+metrics): {res['loss_ms_median']:.2f} ms")
        print(f"median ratio over {args.reps} interleaved reps: {100 * res['ratio_median']:.2f}%")


if __name__ == "__main__":
    main()
