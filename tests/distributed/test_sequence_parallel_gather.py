"""gather_rows_sequence_parallel on gloo: response rows of a sequence-split [S, H] tensor, forward and
backward, equal the single-process index_select (TP 3: unequal row counts, unsorted rows, a rank
with no rows at all)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed._launch import run_workers

S, H = 12, 5


def _data():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(S, H, generator=g, dtype=torch.float64)
    rows = torch.tensor([11, 0, 3, 2, 10, 1])  # 4 on rank 0, none on rank 1 (rows 4..7), 2 on rank 2
    w = torch.randn(len(rows), H, generator=g, dtype=torch.float64)
    return full, rows, w


def _worker(rank: int, world: int) -> dict:
    from megatron_maspo.parallel.sequence_parallel import gather_rows_sequence_parallel

    full, rows, w = _data()
    n = S // world
    local = full[rank * n:(rank + 1) * n].clone().requires_grad_()
    out = gather_rows_sequence_parallel(local, rows, dist.group.WORLD)
    (out * w).sum().backward()  # replicated loss: every rank holds the full [T, H] gradient
    grads: list = [None] * world
    dist.all_gather_object(grads, local.grad)
    return {"out": out.detach(), "grad": torch.cat(grads)}


def test_gather_rows_matches_index_select():
    full, rows, w = _data()
    ref = full.clone().requires_grad_()
    want = ref.index_select(0, rows)
    (want * w).sum().backward()
    for r in run_workers(_worker, 3):
        torch.testing.assert_close(r["out"], want.detach(), rtol=0, atol=0)
        torch.testing.assert_close(r["grad"], ref.grad, rtol=0, atol=0)
