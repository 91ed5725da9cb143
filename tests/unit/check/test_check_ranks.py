"""``maspo check`` builds many ranks in worker processes: the merged result equals one process's."""

from __future__ import annotations

import dataclasses
import pickle

import megatron_maspo.check.ranks as ranks
from megatron_maspo.check.ranks import check_all_ranks, check_ranks
from megatron_maspo.check.steps import CheckError
from megatron_maspo.check.world import coordinates
from megatron_maspo.launch.plan import arch_of
from megatron_maspo.recipes.registry import load_recipe


def test_workers_find_what_one_process_finds(monkeypatch):
    cfg = load_recipe("qwen3_30b_a3b_maspo")  # PP 2 x EP 8: 16 distinct ranks on 16 GPUs
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=16))
    p, spec = cfg.parallel, arch_of(cfg)
    coords = coordinates(16, tp=p.tp, pp=p.pp, ep=p.ep)
    assert len(coords) == 16
    one = check_ranks(cfg, spec, coords, 16)
    monkeypatch.setattr(ranks, "IN_PROCESS_MAX", 0)  # 16 ranks would otherwise stay in process
    two = check_all_ranks(cfg, spec, coords, 16, jobs=2)
    assert (two.n_local, two.n_te, two.counts, two.stages) == (one.n_local, one.n_te, one.counts, one.stages)
    assert sorted(two.shards) == sorted(one.shards)


def test_a_workers_check_error_keeps_its_step():
    err = pickle.loads(pickle.dumps(CheckError("tables", "rank 3: x is in no entry")))
    assert (err.step, err.message, str(err)) == ("tables", "rank 3: x is in no entry", "[tables] rank 3: x is in no entry")
