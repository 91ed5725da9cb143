"""A 2-rank torchrun script with the shape of the rollout pool's first-generation hang (see
test_gpu_emulation.py): rank 1's side thread posts a device-bridge broadcast that rank 0 sends only
after the next step, while both main threads run a collective on the default group first.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_side_thread_hang.py MODE

MODE ``default``: the side thread posts on its default stream (what the old weight receiver did): fine on
gloo, a hang on NCCL, and a named error under ``MASPO_EMULATE_GPU=1``. MODE ``side``: the side thread
posts from ``comm.side_stream()`` and synchronises it before the result is used: fine everywhere.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.bridge import Bridge
from megatron_maspo.parallel.failure import exit_on_error


def main(mode: str) -> None:
    rank, world = comm.init_default_group(120)
    store = comm.job_store(120)
    bridge = Bridge(store, "weights", (0, 1), rank, device=True, timeout_s=120)
    got: list[float] = []
    posting = threading.Event()

    def receive() -> None:  # rank 1: posted before the sender is ready, as the old receiver loop did
        ctx = comm.side_stream("receiver's stream") if mode == "side" else _null()
        with ctx as stream:
            buf = comm.device_empty(4, torch.float32)
            posting.set()
            bridge.broadcast(buf, 0)
            stream.synchronize()
            got.append(float(buf.sum()))

    side = threading.Thread(target=receive, name="side-receiver") if rank == 1 else None
    if side is not None:
        side.start()
        posting.wait(30)
        time.sleep(1.0)  # the receive is posted (on gloo the side thread now sits in it)
    step = comm.all_reduce(torch.ones(1))  # the next step's collective on the default group
    assert float(step.item()) == world
    if rank == 0:  # the sender sends only after its step
        bridge.broadcast(torch.arange(4, dtype=torch.float32), 0)
    if side is not None:
        side.join(60)
        assert got == [6.0], got
    comm.barrier()
    print(f"rank {rank}: done")


class _NullStream:
    def synchronize(self) -> None:
        pass


class _null:
    def __enter__(self):
        return _NullStream()

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    with exit_on_error("side-thread script"):
        main(sys.argv[1])
