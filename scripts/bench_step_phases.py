"""CPU benchmark of one RL step split by phase: generate, grade, old log-probs, train, sync.

Drives the real trainer components of a recipe (the engine, the math grader, the Megatron actor,
the weight sync) in one process and times each phase of ``--steps`` steps after one warm-up step,
the way ``Trainer.train_one_step`` runs them:

* generate: ``engine.generate`` of ``prompts_per_step x group_size`` responses (tokens/s = generated
  tokens / s);
* grade: decode + math-verify of every response (responses/s and tokens/s of graded responses);
* old log-probs: ``actor.old_logprobs.fill`` over the packed micro-batches (tokens/s = packed
  prompt+response tokens / s: what the forward processes);
* train: ``actor.forward_backward`` + ``optimizer_step`` for every mini-batch (same tokens/s base);
* sync: ``sync_weights`` actor -> engine (MB/s of the exported tensors).

It is the baseline for later speed claims: run it before and after a change, same machine, same
recipe. Absolute numbers on a shared CPU runner are noisy; the split is the point.

    OMP_NUM_THREADS=2 python scripts/bench_step_phases.py                      # tiny recipe
    python scripts/bench_step_phases.py --recipe smollm2 --set train.prompts_per_step=4 \\
        --set rollout.group_size=4 --set rollout.max_new_tokens=32 --steps 1   # SmolLM2, small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

PHASES = ("generate", "grade", "old_logprobs", "train", "sync")


def _step(tr, step: int) -> dict[str, dict[str, float]]:
    """One RL step of ``tr`` (a ``Trainer``) timed by phase: {phase: {seconds, units...}}."""
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.train.rollouts.grading import grade_groups
    from megatron_maspo.train.rollouts.groups import samples_from_groups

    rc, tc = tr.cfg.rollout, tr.cfg.train
    idx = tr.rollouts.order.take(tc.prompts_per_step)
    prompts = [tr.examples[i].prompt_ids for i in idx]
    params = SamplingParams(n=rc.group_size, temperature=rc.temperature, top_p=rc.top_p,
                            max_tokens=rc.max_new_tokens, stop_token_ids=[tr.tokenizer.eos_token_id],
                            seed=tc.seed * 7919 + step * 101)
    out: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    comps = tr.rollouts.engine.generate(prompts, params)
    gen_tokens = sum(len(c.token_ids) for g in comps for c in g)
    out["generate"] = {"seconds": time.perf_counter() - t0, "tokens": gen_tokens}
    t0 = time.perf_counter()
    groups = grade_groups(tr.rollouts.shard.grader, tr.tokenizer, idx, prompts,
                          [tr.examples[i].answer for i in idx], comps)
    out["grade"] = {"seconds": time.perf_counter() - t0, "tokens": gen_tokens,
                    "responses": sum(len(g) for g in comps)}
    tr.colocation.prepare_update()
    samples = samples_from_groups(groups, tr.cfg.loss, overlong_filter=tc.overlong_filter, version_offset=0)
    plans, _, _ = tr.actor.plan(samples)
    packed = sum(int(mb.tokens.numel()) for p in plans for mb in p.micro_batches)
    for c in tr.actor.chunks:
        c.train()
    t0 = time.perf_counter()
    tr.actor.old_logprobs.fill(samples, plans)
    out["old_logprobs"] = {"seconds": time.perf_counter() - t0, "tokens": packed}
    t0 = time.perf_counter()
    for plan in plans:
        if plan.num_tokens_global:
            tr.actor.optimizer_step(tr.actor.forward_backward(samples, plan))
    out["train"] = {"seconds": time.perf_counter() - t0, "tokens": packed}
    n_bytes = sum(p.numel() * p.element_size() for c in tr.actor.named_modules_unwrapped()
                  for p in c.parameters())
    t0 = time.perf_counter()
    tr.sync()
    out["sync"] = {"seconds": time.perf_counter() - t0, "bytes": n_bytes}
    return out


def _summary(steps: list[dict]) -> dict[str, dict[str, float]]:
    res = {}
    total = sum(statistics.median(s[p]["seconds"] for s in steps) for p in PHASES)
    for p in PHASES:
        sec = statistics.median(s[p]["seconds"] for s in steps)
        row = {"seconds": sec, "share": sec / total}
        for unit in ("tokens", "responses", "bytes"):
            if unit in steps[0][p]:
                row[f"{unit}_per_s"] = statistics.median(s[p][unit] / s[p]["seconds"] for s in steps)
                row[unit] = steps[0][p][unit]
        res[p] = row
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    from megatron_maspo.overrides import apply_overrides
    from megatron_maspo.recipes.registry import load_recipe
    from megatron_maspo.train.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="bench_phases_") as run_dir:
        cfg = apply_overrides(load_recipe(a.recipe), [
            f"checkpoint.run_dir={run_dir}", "train.sft_steps=0", "logging.plots=false",
            *a.overrides])
        tr = Trainer(cfg)
        try:
            tr.sync()  # the run's initial sync
            steps = [_step(tr, k) for k in range(a.steps + 1)][1:]
        finally:
            tr.rollouts.close()
            from megatron_maspo.parallel.groups import destroy_parallel

            destroy_parallel()
    res = {"recipe": a.recipe, "overrides": a.overrides, "steps": a.steps,
           "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
           "prompts_x_group": [cfg.train.prompts_per_step, cfg.rollout.group_size],
           "max_new_tokens": cfg.rollout.max_new_tokens, "phases": _summary(steps), "raw": steps}
    print(f"recipe {a.recipe} {a.overrides}: {cfg.train.prompts_per_step} prompts x "
          f"{cfg.rollout.group_size} responses, max {cfg.rollout.max_new_tokens} new tokens; "
          f"median of {a.steps} steps after 1 warm-up; {torch.get_num_threads()} threads, load "
          f"{res['load_avg'][0]:.1f}")
    print(f"{'phase':<14}{'s/step':>9}{'share':>8}  throughput")
    for ph, r in res["phases"].items():
        thr = ", ".join(f"{r[k]:,.0f} {k[:-6]}/s" for k in ("tokens_per_s", "responses_per_s")
                        if k in r)
        if "bytes_per_s" in r:
            thr = f"{r['bytes_per_s'] / 2**20:,.1f} MiB/s ({r['bytes'] / 2**20:.1f} MiB)"
        print(f"{ph:<14}{r['seconds']:>9.3f}{r['share']:>8.1%}  {thr}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
