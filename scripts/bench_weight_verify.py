"""What verifying the synced weights costs (docs/weight-verification.md), on the model of
``bench_weight_sync.py`` (the ~38 M-parameter qwen2, 153 MB fp32), 2 gloo ranks (TP 2) -> built-in engine.

Three variants, interleaved in one world (machine noise hits all alike), ``--reps`` times each:

- ``off``:      ``sync_weights`` without digests (``rollout.verify_every=0``): the transfer itself;
- ``sampled``:  a sampled sync under the GPU default (``verify_every=64``, a sync that is not the 64th);
- ``full``:     every tensor digested in full (the CPU default, and the first sync on GPU).

Printed per variant: the sync's wall time on the sender, its overhead over ``off`` (the sender's digests
of the export plus the engine's digests of what it holds; on a shared machine this difference is within
the noise of the transfer), and the engine's ``sync/verify_s``, each also as a % of the ``off`` time.
The sender digests the same tensors the engine does, so its cost is about ``sync/verify_s`` again.

Usage: ``OMP_NUM_THREADS=1 python scripts/bench_weight_verify.py [--bucket-mb 64] [--reps 3]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_maspo.parallel.launch import run_workers

VARIANTS = {"off": (1, 0), "sampled": (1, 64), "full": (0, 1)}
"""name -> (sync index, rollout.verify_every) given to ``digest.plan``."""


def _worker(rank: int, world: int, bucket_mb: float, reps: int):
    from bench_weight_sync import SPEC  # scripts/ is on sys.path (also in the spawned worker)

    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout import digest
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb, sync_weights

    groups = init_parallel(tp=world, pp=1, seed=0)
    chunks = build_model_chunks(SPEC, ModelBuildOptions(tp=world, pp=1), pp_rank=groups.pp_rank)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC)) if rank == 0 else None
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters()) if engine else 0
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    verify: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for rep in range(reps + 1):  # rep 0 warms up (first-touch page faults, allocator), not recorded
        for name, (index, every) in VARIANTS.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            sync_weights(chunks, SPEC, groups, engine, bucket_bytes=bucket_bytes_from_mb(bucket_mb),
                         verify_checksums=False, digests=digest.plan(index, every))
            torch.distributed.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
                verify[name].append(engine.verify_s if engine is not None else 0.0)
    return {"bytes": nbytes, "times": times, "verify": verify} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    res = run_workers(_worker, 2, a.bucket_mb, a.reps, timeout_s=900)[0]
    off = statistics.median(res["times"]["off"])
    print(f"model {res['bytes'] / 1e6:.0f} MB fp32, TP=2, bucket {a.bucket_mb:g} MiB, {a.reps} reps (median); "
          f"transfer (verify off) {off:.3f} s")
    for name in VARIANTS:
        t, v = statistics.median(res["times"][name]), statistics.median(res["verify"][name])
        print(f"{name:>8}: sync {t:7.3f} s  overhead {t - off:+7.3f} s ({100 * (t - off) / off:+6.1f}%)  "
              f"engine sync/verify_s {v:7.4f} s ({100 * v / off:5.1f}% of the transfer)")


if __name__ == "__main__":
    main()
