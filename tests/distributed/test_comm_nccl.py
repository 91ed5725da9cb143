"""comm.py on a real NCCL group (one GPU, one rank): CPU control tensors are staged through the GPU.

A raw ``dist.all_reduce`` of a CPU tensor fails on NCCL; the same call through comm.py succeeds and
leaves the result where the caller's tensor lives. One rank suffices: tensor collectives in comm.py
run on any initialised group, a one-rank one included.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed._launch import run_workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _on_nccl(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_maspo.parallel import comm

    out = {"backend": dist.get_backend(), "device": str(comm.comm_device())}
    try:
        dist.all_reduce(torch.ones(1))
        out["raw"] = "no error"
    except Exception as e:  # NCCL refuses CPU tensors
        out["raw"] = type(e).__name__
    t = torch.tensor([2.0, 3.0])
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    out["cpu_result"] = (t.device.type, t.tolist())
    buf = torch.empty(2)
    buf.copy_(torch.tensor([5.0, 6.0]))
    out["bcast"] = comm.broadcast(buf, src=0).tolist()
    out["gather_dev"] = [p.device.type for p in comm.all_gather(torch.ones(3))]
    g = torch.ones(2, device="cuda")
    out["cuda_kept"] = comm._staged(g, None) is g
    out["flag"] = comm.any_true(True)
    out["obj"] = comm.broadcast_object({"a": 1})
    return out


def test_cpu_tensors_are_staged_through_the_gpu():
    (r,) = run_workers(_on_nccl, 1)
    assert r["backend"] == "nccl" and r["device"].startswith("cuda")
    assert r["raw"] != "no error"
    assert r["cpu_result"] == ("cpu", [2.0, 3.0])
    assert r["bcast"] == [5.0, 6.0] and r["gather_dev"] == ["cpu"]
    assert r["cuda_kept"] and r["flag"] and r["obj"] == {"a": 1}
