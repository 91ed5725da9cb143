"""``parallel/comm.py`` on 2 gloo ranks, NCCL's device rule emulated on CPU, and prompt failure.

NCCL accepts CUDA tensors only. On CPU we emulate that rule with a device-mapped gloo group,
``backend="cuda:gloo"``: a raw collective on a CPU tensor then fails exactly like on NCCL (``No
backend type associated with device type cpu``), and comm.py must route the tensor to CUDA instead
(on a CPU-only build that move is what fails, proving where comm.py sent it).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.launch import (  # the package helper itself (fresh worlds)
    WorkerError,
    run_workers,
)


def _collectives(rank: int, world: int) -> dict:
    out: dict = {}
    t = torch.tensor([rank + 1.0])
    assert comm.all_reduce(t) is t  # in place, same object
    out["sum"] = t.item()
    i = torch.tensor([rank * 10], dtype=torch.int64)
    comm.all_reduce(i, op=comm.ReduceOp.MAX)
    out["max_int"] = (i.dtype, i.item())
    nc = torch.arange(6.0).view(2, 3).t() * (rank + 1)  # non-contiguous: staged and written back
    comm.all_reduce(nc)
    out["noncontig"] = nc.clone()
    buf = torch.full((3,), 7.0) if rank == 1 else torch.empty(3)  # receive buffer made on the CPU
    comm.broadcast(buf, src=1)
    out["bcast"] = buf.tolist()
    out["gather"] = [p.item() for p in comm.all_gather(torch.tensor([float(rank)]))]
    out["obj"] = comm.broadcast_object({"from": rank}, src=0)
    out["objs"] = comm.all_gather_object(rank * 2)
    out["any"] = comm.any_true(rank == 1)
    out["none"] = comm.any_true(False)
    if rank == 0:
        comm.send(torch.tensor([3.5, 4.5]), dst=1)
    else:
        r = torch.zeros(2)
        comm.recv(r, src=0)
        out["recv"] = r.tolist()
    comm.barrier()
    # Groups carry their device: CPU for cpu:gloo, CUDA for the NCCL emulation.
    cpu_group = dist.new_group([0, 1], backend="cpu:gloo")
    out["cpu_dev"] = comm.comm_device(cpu_group).type
    out["cpu_sum"] = comm.all_reduce(torch.ones(2), group=cpu_group).tolist()
    nccl_like = dist.new_group([0, 1], backend="cuda:gloo")
    out["nccl_like_dev"] = comm.comm_device(nccl_like).type
    try:
        dist.all_reduce(torch.ones(1), group=nccl_like)
        out["raw_error"] = None
    except RuntimeError as e:
        out["raw_error"] = str(e)
    if not torch.cuda.is_available():
        try:
            comm.all_reduce(torch.ones(1), group=nccl_like)
            out["comm_error"] = None
        except (RuntimeError, AssertionError) as e:
            out["comm_error"] = str(e)
    return out


def test_collectives_match_reference_and_follow_group_device():
    res = run_workers(_collectives, 2)
    for r in res:
        assert r["sum"] == 3.0
        assert r["max_int"] == (torch.int64, 10)
        torch.testing.assert_close(r["noncontig"], torch.arange(6.0).view(2, 3).t() * 3)
        assert r["bcast"] == [7.0, 7.0, 7.0]
        assert r["gather"] == [0.0, 1.0]
        assert r["obj"] == {"from": 0} and r["objs"] == [0, 2]
        assert r["any"] is True and r["none"] is False
        assert r["cpu_dev"] == "cpu" and r["cpu_sum"] == [2.0, 2.0]
        assert r["nccl_like_dev"] == "cuda"
        # the emulated NCCL rule: a CPU tensor has no backend on this group...
        assert "No backend type associated with device type cpu" in r["raw_error"]
        if "comm_error" in r:  # ...and comm.py sent it to CUDA instead (absent on this build)
            assert r["comm_error"] and "No backend type" not in r["comm_error"]
            assert "CUDA" in r["comm_error"] or "cuda" in r["comm_error"]
    assert res[1]["recv"] == [3.5, 4.5]


def test_single_process_is_a_no_op():
    assert not comm.active()
    t = torch.tensor([2.0])
    assert comm.all_reduce(t) is t and t.item() == 2.0
    assert comm.broadcast_object("x") == "x" and comm.all_gather_object(1) == [1]
    assert comm.all_gather(t) == [t] and comm.any_true(True) and not comm.any_true(False)
    comm.barrier()


def _one_rank_raises(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("boom on rank 1")
    comm.broadcast_object(None, src=1)  # rank 0 waits for rank 1, which never sends


def test_failure_on_one_rank_ends_all_promptly_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        run_workers(_one_rank_raises, 2, timeout_s=300)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "boom on rank 1" in msg
    assert msg.index("--- rank 1 ---") < msg.find("--- rank 0 ---") or "--- rank 0 ---" not in msg
    assert took < 60, f"took {took:.0f} s (the group timeout is 300 s)"
