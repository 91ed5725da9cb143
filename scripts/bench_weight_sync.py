"""Weight-sync throughput on CPU gloo: Megatron (2 ranks) -> HF export -> flat buckets -> built-in engine.

Runs three variants interleaved in the same world (so machine noise hits all alike) and prints GB/s and
ratios against the baseline:

- ``baseline``: the same export stream copied tensor by tensor into the engine (``load_weights``), no buckets;
- ``bucketed``: :func:`sync_weights` with flat buckets, no checksums;
- ``bucketed+crc``: the same with per-bucket crc32 on both sides (the default).

Usage: ``OMP_NUM_THREADS=1 python scripts/bench_weight_sync.py [--tp 2|--pp 2] [--bucket-mb 64] [--reps 3]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.launch import run_workers

# ~38 M parameters (fp32 ~153 MB): tied 16k x 768 embedding + 4 GQA layers.
SPEC = ArchSpec(family="qwen2", num_layers=4, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
                num_query_groups=4, kv_channels=64, vocab_size=16000, max_position_embeddings=256,
                add_qkv_bias=True, tie_word_embeddings=True)


def _worker(rank: int, world: int, tp: int, pp: int, bucket_mb: float, reps: int):
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb, sync_weights

    groups = init_parallel(tp=tp, pp=pp, seed=0)
    chunks = build_model_chunks(SPEC, ModelBuildOptions(tp=tp, pp=pp), pp_rank=groups.pp_rank)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC)) if rank == 0 else None
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters()) if engine else 0
    times: dict[str, list[float]] = {"baseline": [], "bucketed": [], "bucketed+crc": []}
    for _ in range(reps):
        for name in times:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if name == "baseline":
                stream = export_hf_weights(chunks, SPEC, groups)
                if engine is not None:
                    engine.load_weights(stream)
                else:
                    for _ in stream:
                        pass
            else:
                sync_weights(chunks, SPEC, groups, engine, bucket_bytes=bucket_bytes_from_mb(bucket_mb),
                             verify_checksums=name.endswith("crc"))
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
    return {"bytes": nbytes, "times": times} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    res = run_workers(_worker, a.tp * a.pp, a.tp, a.pp, a.bucket_mb, a.reps, timeout_s=900)[0]
    gb = res["bytes"] / 1e9
    base = statistics.median(res["times"]["baseline"])
    print(f"model {gb * 1e3:.0f} MB fp32, TP={a.tp} PP={a.pp}, bucket {a.bucket_mb:g} MiB, {a.reps} reps (median)")
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        print(f"{name:>14}: {med:7.3f} s  {gb / med:6.3f} GB/s  time ratio vs baseline {med / base:5.2f}")


if __name__ == "__main__":
    main()
