"""Routing replay on the tiny Qwen3-MoE: does the trainer route like the engine, and does replay help?

One gloo rank. A random tiny Qwen3-MoE (transformers) is loaded into the Megatron actor (fp32) and into
the built-in engine (``--engine-dtype``: bf16 emulates a bf16 inference engine against an fp32 trainer;
fp32 is the matched setting). The engine samples responses and reports each token's experts; then, on
the same samples and weights, the actor computes old log-probs three ways in the same run:

* ``record``: its own routing, recorded through Megatron's ``RouterReplay`` (RECORD action) and compared
  with the engine's: ``routing/changed_frac`` = fraction of (token, layer) pairs whose top-k *set*
  differs, ``routing/changed_token_frac`` = fraction of tokens with a different set in some layer;
* ``off``: no replay -> ``mismatch/*`` of trainer vs engine log-probs (rollout/diagnostics.py);
* ``replay``: the engine's experts replayed -> the same ``mismatch/*``.

Usage: ``OMP_NUM_THREADS=1 python scripts/moe_routing_replay.py [--engine-dtype bf16|fp32] [--prompts 16]
[--group 4] [--max-tokens 24] [--layers 4] [--seed 0] [--json]``
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from megatron_maspo.parallel.launch import run_workers


def _worker(rank: int, world: int, args: dict) -> dict:
    import copy
    from functools import partial

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_maspo.config import MaspoConfig
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.model.config import ModelConfig
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.parallel.config import ParallelConfig
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.diagnostics import mismatch_metrics
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.train.actor.routing_replay import replay_targets
    from megatron_maspo.train.actor.samples import Sample
    from megatron_maspo.train.components import build_actor
    from megatron_maspo.train.config import TrainConfig

    with tempfile.TemporaryDirectory() as d:
        model, hf_cfg = make_tiny_hf_model("qwen3_moe", d, seed=args["seed"],
                                           num_hidden_layers=args["layers"])
        spec = arch_spec_from_hf(hf_cfg)
        groups = init_parallel(seed=11)
        cfg = MaspoConfig(model=ModelConfig(routing_replay="old_logprobs"),
                          parallel=ParallelConfig(world_size=1),
                          train=TrainConfig(mini_batches_per_step=1, max_tokens_per_micro_batch=1 << 16))
        actor = build_actor(cfg, spec, groups, init_weights=partial(
            load_hf_weights, spec=spec, groups=groups, source=d))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args["engine_dtype"]]
    engine = BuiltinEngine(copy.deepcopy(model).to(dtype), device="cpu")
    engine.record_routing = True
    g = torch.Generator().manual_seed(args["seed"])
    prompts = [torch.randint(3, hf_cfg.vocab_size, (int(torch.randint(6, 14, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args["prompts"])]
    out = engine.generate(prompts, SamplingParams(n=args["group"], temperature=1.0,
                                                  max_tokens=args["max_tokens"], seed=args["seed"]))
    samples = [Sample(prompt_ids=p, response_ids=c.token_ids, advantage=0.0, prompt_index=i,
                      rollout_logprobs=c.logprobs, routed_experts=c.routed_experts)
               for i, (p, cs) in enumerate(zip(prompts, out)) for c in cs]
    plans, _, _ = actor.plan(samples)
    mbs = [mb for p in plans for mb in p.micro_batches]
    assert len(mbs) == 1, "the probe packs everything into one micro-batch"
    mb = mbs[0]

    # 1. the trainer's own routing, recorded, vs the engine's (positions the engine reported)
    rr = [r for r in actor.replay.per_chunk[0]]
    for r in rr:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    actor.logprobs_local(samples, plans, model="policy", replay=False)
    own = torch.stack([r.router_replay.get_recorded_indices().cpu() for r in rr])  # [L, S, k]
    actor.replay.clear()
    eng = replay_targets(samples, mb, num_layers=spec.num_layers, topk=spec.moe_router_topk)
    covered = torch.zeros(own.shape[1], dtype=torch.bool)
    start = 0
    for i, n in zip(mb.sample_index, mb.seq_lens):
        covered[start:start + min(n, samples[i].routed_experts.shape[0])] = True
        start += n
    differs = (own.sort(-1).values != eng.sort(-1).values).any(-1)[:, covered]  # [L, covered]
    res = {"engine_dtype": args["engine_dtype"], "tokens": int(covered.sum()), "layers": spec.num_layers,
           "routing/changed_frac": float(differs.float().mean()),
           "routing/changed_token_frac": float(differs.any(0).float().mean())}

    # 2./3. old log-probs without and with replay vs the engine's log-probs
    ro = torch.cat([torch.tensor(s.rollout_logprobs) for s in samples])
    for name, replay in (("off", False), ("replay", True)):
        lp = actor.logprobs_local(samples, plans, model="policy", replay=replay)
        tr = torch.cat([lp[i][0] for i in range(len(samples))])
        for k, v in mismatch_metrics(tr, ro, torch.ones_like(tr)).items():
            res[f"{name}/{k}"] = float(v)
    return res


def measure(**kw) -> dict:
    """Run the probe in a 1-rank gloo world; see the module docstring for the keys."""
    args = dict(engine_dtype="bf16", prompts=16, group=4, max_tokens=24, layers=4, seed=0)
    args.update(kw)
    return run_workers(_worker, 1, args)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    res = measure(engine_dtype=a.engine_dtype, prompts=a.prompts, group=a.group, max_tokens=a.max_tokens,
                  layers=a.layers, seed=a.seed)
    if a.json:
        print(json.dumps(res))
        return
    print(f"engine {res['engine_dtype']} vs trainer fp32: {res['tokens']} tokens x {res['layers']} layers")
    print(f"  top-k set differs: {res['routing/changed_frac']:.2%} of (token, layer) pairs, "
          f"{res['routing/changed_token_frac']:.2%} of tokens")
    for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3"):
        off, rep = res[f"off/mismatch/{k}"], res[f"replay/mismatch/{k}"]
        print(f"  mismatch/{k:<22} no replay {off:.4e}   replay {rep:.4e}   ratio {rep / off if off else float('nan'):.3f}")


if __name__ == "__main__":
    main()
