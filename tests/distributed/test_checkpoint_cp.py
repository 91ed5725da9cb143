"""A checkpoint written at CP 2 resumes at CP 1 and back (2 gloo ranks, torch_dist resharding).

CP ranks hold identical weights (Megatron gives them distinct replica ids, so each tensor is saved
once): the loaded actor's parameters, Adam moments and log-probs must equal the saved one's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _actor(world: int, cp: int):
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    cfg = H.make_cfg(world, budget=72 // cp, mini_batches=1)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=cp))
    spec = H.qwen2_spec()
    groups = init_parallel(cp=cp, seed=11)
    return build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))


def _adam(actor) -> torch.Tensor:
    """Sum of |exp_avg| + |exp_avg_sq| over this rank's optimizer state (a replica's fingerprint)."""
    total = torch.zeros((), dtype=torch.float64)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for st in opt.optimizer.state.values():
            total += st["exp_avg"].double().abs().sum() + st["exp_avg_sq"].double().abs().sum()
    return total


def _worker(rank: int, world: int, root: str) -> dict:
    from megatron_maspo.train.actor.checkpoint import load_checkpoint, save_checkpoint

    probe = H.make_samples(seed=3)
    out: dict = {}
    for step, (src, dst) in enumerate(((2, 1), (1, 2)), start=1):
        a = _actor(world, src)
        a.train_step(H.make_samples(seed=step))
        path = save_checkpoint(a, f"{root}/{src}to{dst}", step, data_state={"step": step})
        saved = {"params": H.full_tensors(a, grads=False), "lp": a.compute_logprobs(probe)[0],
                 "adam": _adam(a)}
        b = _actor(world, dst)
        out_state = load_checkpoint(b, path)
        loaded = {"params": H.full_tensors(b, grads=False), "lp": b.compute_logprobs(probe)[0],
                  "adam": _adam(b), "data": out_state, "steps": b.steps_done}
        out[f"{src}to{dst}"] = (saved, loaded)
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_workers(_worker, 2, str(tmp_path_factory.mktemp("cp_ckpt")))[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2to1", "1to2"])
def test_checkpoint_moves_between_cp_sizes(results, case):
    saved, loaded = results[case]
    assert loaded["steps"] == 1 and loaded["data"] == {"step": 1 if case == "2to1" else 2}
    for k, v in saved["params"].items():
        assert torch.equal(v, loaded["params"][k]), k
    for x, y in zip(saved["lp"], loaded["lp"]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # rank 0's Adam state: the same replica's moments at either CP size (no DP sharding here)
    torch.testing.assert_close(saved["adam"], loaded["adam"], rtol=1e-12, atol=0)
