"""Only the sender's model-parallel replica runs the export collectives (DP replicas skip them)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_maspo.parallel.launch import run_workers


def _worker(rank: int, world: int) -> tuple:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.weight_sync import joins_export, sync_weights

    out = []
    for tp, ep in ((2, 1), (1, 1), (4, 1), (1, 2)):
        g = init_parallel(tp=tp, ep=ep)
        out.append((tp, ep, g.dp_rank, joins_export(g, 0), joins_export(g, world - 1)))
    g = init_parallel(tp=2)
    if not joins_export(g, 0):
        # returns before touching the model, the engine or any collective
        stats = sync_weights(None, None, g, None, bucket_bytes=1)
        assert stats.num_bytes == stats.num_tensors == 0
    dist.barrier()
    return tuple(out)


def test_dp_replicas_skip_the_export():
    res = run_workers(_worker, 4)
    for rank, rows in enumerate(res):
        for tp, ep, dp_rank, to_first, to_last in rows:
            if ep > 1 or tp == 4:  # EP gathers span DP; tp 4 is one replica
                assert to_first and to_last, (rank, tp, ep)
            else:  # TP-fastest order: rank // tp is the replica
                assert dp_rank == rank // tp, (rank, tp, dp_rank)
                assert to_first == (rank // tp == 0), (rank, tp)
                assert to_last == (rank // tp == (4 - 1) // tp), (rank, tp)
