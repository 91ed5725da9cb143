"""Single-controller dispatch: the bytes a NeMo-RL-style driver ships per trainer call, and what the planner
adds for them when ``controller_gb_s`` is set (launch/plan/dispatch.py)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.dispatch import (
    LOGPROB_IN_BYTES,
    LOGPROB_OUT_BYTES,
    TRAIN_IN_BYTES,
    DispatchLoad,
    dispatch_bytes,
    dispatch_seconds,
    measure_gb_s,
    step_dispatch_seconds,
)
from megatron_maspo.recipes.registry import load_recipe


def _shard(seqs: int, length: int, train: bool) -> dict[str, torch.Tensor]:
    """One data-parallel shard as NeMo-RL v0.3.0's grpo.py builds it (dtypes as there)."""
    d = {"input_ids": torch.zeros(seqs, length, dtype=torch.int64),
         "token_mask": torch.ones(seqs, length, dtype=torch.int64),
         "advantages": torch.zeros(seqs, length), "generation_logprobs": torch.zeros(seqs, length),
         "input_lengths": torch.full((seqs,), length), "sample_mask": torch.ones(seqs)}
    if train:
        d |= {"prev_logprobs": torch.zeros(seqs, length), "reference_policy_logprobs": torch.zeros(seqs, length)}
    return d


@pytest.mark.parametrize("train", [False, True])
def test_byte_constants_are_what_pickle_ships(train):
    """The per-slot constants match the pickled size of a real shard (per-sequence fields and pickle
    framing are under 1%)."""
    seqs, length = 16, 1024
    shipped = len(pickle.dumps(_shard(seqs, length, train), protocol=5))
    load = DispatchLoad(seqs=seqs, padded_len=length, replicas=1,
                        in_bytes=TRAIN_IN_BYTES if train else LOGPROB_IN_BYTES, out_bytes=0)
    assert dispatch_bytes(load) == pytest.approx(shipped, rel=0.01)
    result = len(pickle.dumps({"logprobs": torch.zeros(seqs, length)}, protocol=5))
    assert seqs * length * LOGPROB_OUT_BYTES == pytest.approx(result, rel=0.01)


def test_traffic_scales_with_model_parallel_copies_and_padded_length():
    base = DispatchLoad(seqs=2048, padded_len=4096, replicas=16, in_bytes=24, out_bytes=4)
    assert dispatch_bytes(base) == 16 * 2048 * 4096 * 28
    assert dispatch_bytes(dataclasses.replace(base, replicas=64, padded_len=16384)) == 16 * dispatch_bytes(base)
    assert dispatch_seconds(base, 2.0) == pytest.approx(dispatch_bytes(base) / 2e9)
    with pytest.raises(ValueError, match="controller_gb_s must be > 0"):
        dispatch_seconds(base, 0.0)


def _cfg(tp: int, pp: int):
    cfg = load_recipe("qwen25_7b_maspo")
    cfg.model.arch = "llama3.1-70b"
    cfg.parallel = dataclasses.replace(cfg.parallel, tp=tp, pp=pp, world_size=64)
    cfg.rollout.vllm_tp = 4
    cfg.train.reference_model = True
    return cfg


@pytest.mark.parametrize("tp,pp", [(4, 2), (4, 4)])
def test_estimate_adds_dispatch_to_logprob_and_update_only(tp, pp):
    """With a controller, old-logprob gains two log-prob calls (policy + reference) and update one train
    call, each over tp*pp*cp copies of the batch padded to prompt + longest response; nothing else moves.
    Without one (the default: this trainer), nothing is added."""
    cfg = _cfg(tp, pp)
    kw = dict(nodes=8, gpus_per_node=8)
    hw = Assumptions(prompt_mean=150, response_mean=400, response_max=3000)
    off = estimate(cfg, arch_of(cfg), layout_of(cfg), hw=hw, **kw)
    on = estimate(cfg, arch_of(cfg), layout_of(cfg), hw=dataclasses.replace(hw, controller_gb_s=1.5), **kw)
    assert Assumptions().controller_gb_s is None
    lp, up = step_dispatch_seconds(seqs=cfg.train.prompts_per_step * cfg.rollout.group_size,
                                   padded_len=150 + 3000, replicas=tp * pp, reference=True, controller_gb_s=1.5)
    assert on.time.old_logprob - off.time.old_logprob == pytest.approx(lp)
    assert on.time.update - off.time.update == pytest.approx(up)
    assert (on.time.generation, on.time.sync) == (off.time.generation, off.time.sync)
    assert on.memory == off.memory


def test_cli_takes_the_rate_and_refuses_a_bad_one(capsys):
    args = ["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4"]
    main([*args, "--controller-gb-s", "1.5"])
    assert "'controller_gb_s': 1.5" in capsys.readouterr().out
    assert main([*args, "--controller-gb-s", "0"]) == 2
    assert "--controller-gb-s must be > 0" in capsys.readouterr().err


def test_the_rate_can_be_measured_here():
    assert measure_gb_s(seqs=4, length=1024, repeats=1) > 0.0
