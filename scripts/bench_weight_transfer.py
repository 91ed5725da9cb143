"""Weight transfer between the pools on CPU gloo: the rank-0 funnel vs every stage sending its own tensors.

One world per trainer layout (PP 1, 2, 4 and EP 2; TP 1), each a training pool of real Megatron chunks and a
rollout pool of two built-in engines, the bridges exactly as a disaggregated job builds them
(``rollout.sync_senders=stages``: one link per sender). In each world the two modes alternate, ``--reps``
times each (machine noise hits both alike):

- ``funnel``: ``sync_weights`` (the export gathers every tensor onto trainer rank 0, which sends it all over
  its own link: the engines read only that link);
- ``stages``: ``sync_weights_sharded`` by the transfer plan (every sender its own tensors over its own link).

Printed per layout (medians): sync seconds (``sync/transfer_s``: the trainers' common start to the last
payload staged on the slowest engine, one host's clock), the most bytes one trainer rank sent
(``sync/sender_bytes_max``) over the model's bytes, and the ratios stages / funnel.

Usage: ``OMP_NUM_THREADS=1 python scripts/bench_weight_transfer.py [--reps 3] [--bucket-mb 16]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.launch import free_port, run_workers

# ~38 M parameters (fp32 ~153 MB): tied 16k x 768 embedding + 4 GQA layers (scripts/bench_weight_sync.py's).
DENSE = ArchSpec(family="qwen2", num_layers=4, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
                 num_query_groups=4, kv_channels=64, vocab_size=16000, max_position_embeddings=256,
                 add_qkv_bias=True, tie_word_embeddings=True)
# ~35 M parameters: 4 layers of 8 experts.
MOE = ArchSpec(family="qwen3_moe", num_layers=4, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
               num_query_groups=4, kv_channels=64, vocab_size=8000, max_position_embeddings=256,
               qk_layernorm=True, num_moe_experts=8, moe_ffn_hidden_size=768, moe_router_topk=2)
ENGINES = 2


def _receive(links) -> tuple[list, float]:
    """One sync's buckets from ``links`` (the ``(bridge, ctl)`` links in use), each drained by a thread of its
    own to its ``end`` as ``WeightReceiver`` does, and when the last payload landed."""
    import threading

    from megatron_maspo.rollout.buckets import Bucket, meta_from_wire

    per_link: list[list] = [[] for _ in links]
    ends = [0.0] * len(links)

    def drain(i: int) -> None:
        bridge, ctl = links[i]
        while True:
            msg = ctl.broadcast_object(None, 0)
            if "end" in msg:
                ends[i] = time.time()
                return
            buf = torch.empty(msg["n"], dtype=torch.uint8)
            bridge.broadcast(buf, 0)
            per_link[i].append(Bucket(buf, [meta_from_wire(w) for w in msg["bucket"]], msg["crc"], msg["index"]))

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(links))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [b for bs in per_link for b in bs], max(ends)


def _worker(rank: int, world: int, port: int, spec: ArchSpec, pp: int, ep: int, bucket_mb: float, reps: int):
    import torch.distributed as dist

    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.config import RolloutConfig
    from megatron_maspo.rollout.pool_sync import WeightSender
    from megatron_maspo.rollout.pools import TRAIN, PoolLayout
    from megatron_maspo.rollout.transfer_plan import plan_pool_transfer
    from megatron_maspo.rollout.weight_sync import (
        bucket_bytes_from_mb,
        sync_weights,
        sync_weights_sharded,
    )
    from megatron_maspo.train.process.distributed import JobPools
    from megatron_maspo.train.rollouts.pool import bridges, receiving_end, sending_end

    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    lay = PoolLayout(world=world, engine_ranks=ENGINES, pp=pp, ep=ep, moe=spec.is_moe)
    role = lay.role(rank)
    comm.init_pool_group(store, role, lay.pool_rank(rank), lay.trainer_world if role == TRAIN else ENGINES, 600)
    links, _ = bridges(RolloutConfig(placement="disaggregated", engine_ranks=ENGINES, pool_timeout_s=600),
                       JobPools(lay, rank, store))
    modes = ["funnel", "stages"] * reps
    cap = bucket_bytes_from_mb(bucket_mb)
    if role != TRAIN:
        from megatron_maspo.model.hf_config import hf_config_dict
        from megatron_maspo.rollout.builtin_engine import BuiltinEngine

        engine = BuiltinEngine.from_hf_config(hf_config_dict(spec))
        ordered, _ = receiving_end(links)  # one link per sender here (PoolLayout's default cap of 16)
        ends = []
        for mode in modes:
            staged, end = _receive(ordered[:1] if mode == "funnel" else ordered)
            engine.load_buckets(staged, verify=False)
            ends.append(end)
        return {"ends": ends}
    groups = init_parallel(pp=pp, ep=ep, seed=0)
    chunks = build_model_chunks(spec, ModelBuildOptions(pp=pp, ep=ep), pp_rank=groups.pp_rank)
    plan = plan_pool_transfer(spec, lay, "float32")
    sender = sending_end(links, rank)
    funnel = WeightSender(sender.bridge, sender.ctl) if rank == 0 else None  # rank 0's link alone
    starts, sent = [], []
    for mode in modes:
        comm.barrier()
        starts.append(time.time())
        if mode == "funnel":
            stats = sync_weights(chunks, spec, groups, funnel, bucket_bytes=cap, verify_checksums=False)
        else:
            stats = sync_weights_sharded(chunks, spec, groups, sender, plan, bucket_bytes=cap,
                                         verify_checksums=False)
        sent.append(stats.payload_bytes)
    return {"starts": starts, "sent": sent, "total": plan.bytes_total}


def _summary(res: list, trainers: int, reps: int) -> dict:
    modes = ["funnel", "stages"] * reps
    out: dict[str, dict] = {}
    for i, mode in enumerate(modes):
        start = min(r["starts"][i] for r in res[:trainers])
        end = max(r["ends"][i] for r in res[trainers:] if r)
        top = max(r["sent"][i] for r in res[:trainers])
        out.setdefault(mode, {"s": [], "share": top / res[0]["total"]})["s"].append(end - start)
    return {m: {"s": statistics.median(v["s"]), "share": v["share"]} for m, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    args = ap.parse_args()
    cases = [("PP 1", DENSE, 1, 1), ("PP 2", DENSE, 2, 1), ("PP 4", DENSE, 4, 1), ("EP 2 (MoE)", MOE, 1, 2)]
    print(f"{'layout':<11} {'MB/sync':>8} {'funnel s':>9} {'stages s':>9} {'time ratio':>11} "
          f"{'funnel max-sender':>18} {'stages max-sender':>18} {'bytes ratio':>12}")
    for name, spec, pp, ep in cases:
        trainers = pp * ep
        res = run_workers(_worker, trainers + ENGINES, free_port(), spec, pp, ep, args.bucket_mb, args.reps,
                          timeout_s=1800)
        s = _summary(res, trainers, args.reps)
        f, g = s["funnel"], s["stages"]
        print(f"{name:<11} {res[0]['total'] / 1e6:>8.0f} {f['s']:>9.3f} {g['s']:>9.3f} {g['s'] / f['s']:>11.2f} "
              f"{f['share']:>18.2f} {g['share']:>18.2f} {g['share'] / f['share']:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
