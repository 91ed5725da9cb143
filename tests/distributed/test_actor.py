"""MegatronActor on gloo: TP/PP/DP/EP layouts reproduce 1x1x1; ratio = 1; NaN skip; TP2 → TP1 resume.

Default: three spawned worlds (1, 2 and 4 ranks); each runs several layouts and checks, and rank 0
returns the numbers. The 1-rank world is the reference every dense layout is compared against:
TP2 (2 ranks), TP2xPP2 and TP2xDP2 with the distributed optimizer (4 ranks). The 2-rank world also
checks the NaN skip, TP2 -> TP1 checkpoint resume and Qwen3-MoE EP=2 against EP=1 (both DP=2).
``slow``: one more 4-rank world (PP2xDP2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _procedure(actor) -> dict:
    """Two optimizer steps by hand (grads captured), then one full ``train_step``."""
    samples = H.make_samples()
    out = {"lp_before": actor.compute_logprobs(samples)[0]}
    plans, _, _ = actor.plan(samples)
    actor.old_logprobs.fill(samples, plans)
    for k, plan in enumerate(plans):
        ctx = actor.forward_backward(samples, plan)
        if k == 0:
            out["first_dev"] = actor.old_logprobs.first_ratio_dev(samples, plan, ctx)
        out[f"loss{k}"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
        out[f"grads{k}"] = H.full_tensors(actor, grads=True)
        out[f"step{k}"] = actor.optimizer_step(ctx)
    out["params"] = H.full_tensors(actor, grads=False)
    out["lp_after"] = actor.compute_logprobs(samples)[0]
    out["train_step"] = actor.train_step(H.make_samples(seed=1))
    return out


def _adam_state(actor) -> dict[str, torch.Tensor]:
    """Every torch-Adam state tensor of the (chained) Megatron optimizer, cloned."""
    out = {}
    for j, opt in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        for i, st in enumerate(opt.optimizer.state.values()):
            out.update({f"{j}.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    assert out, "Adam state is empty: the optimizer has not stepped"
    return out


def _reference_worker(rank: int, world: int) -> dict:
    res = {"qwen2": _procedure(H.build_actor(world))}
    # robustness at 1 rank: over-long prompt/response, empty response
    actor = H.build_actor(world, budget=24)
    samples = H.make_samples()
    samples[0].response_ids = []
    samples[1].prompt_ids = list(range(1, 25))  # fills the whole budget: nothing to train on
    samples[2].response_ids = samples[2].response_ids + [5] * 30  # cut to fit 24 tokens
    cut = [len(s.response_ids) - max(0, min(len(s.response_ids), 24 - len(s.prompt_ids)))
           for s in samples]
    res["robust"] = actor.train_step(samples)
    res["robust_expected"] = (sum(c > 0 for c in cut), sum(cut))
    return res


def _two_rank_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    from megatron_maspo.train.actor.checkpoint import (
        list_checkpoints,
        load_checkpoint,
        save_checkpoint,
    )

    res: dict = {}
    actor = H.build_actor(world, tp=2)
    res["tp2"] = _procedure(actor)
    # NaN gradient on rank 0 only: every rank must skip, weights and Adam state untouched
    before = H.full_tensors(actor, grads=False)
    state_before = _adam_state(actor)
    p = next(actor.chunks[0].module.parameters())
    handle = p.register_hook(lambda g: g * float("nan")) if rank == 0 else None
    m = actor.train_step(H.make_samples(seed=2))
    if handle is not None:
        handle.remove()
    after = H.full_tensors(actor, grads=False)
    state_after = _adam_state(actor)
    res["nan"] = {"skipped": m["actor/steps_skipped"], "steps_done": actor.steps_done,
                  "params_equal": all(torch.equal(before[k], after[k]) for k in before),
                  "opt_equal": all(torch.equal(state_before[k], state_after[k]) for k in state_before)}
    # save at TP2, keep_last=1 across two saves, reload at TP1 x DP2
    save_checkpoint(actor, ckpt_dir, 1, data_state={"epoch": 0, "cursor": 3}, keep_last=1)
    path = save_checkpoint(actor, ckpt_dir, 2, data_state={"epoch": 1, "cursor": 7}, keep_last=1)
    res["ckpt_dirs"] = [c.name for c in list_checkpoints(ckpt_dir)]
    from megatron_maspo.model.spec_record import read_spec_record

    res["spec_record"] = read_spec_record(path)  # the spec that built it travels with it
    probe = H.make_samples(seed=3)
    res["lp_saved"] = actor.compute_logprobs(probe)[0]
    actor2 = H.build_actor(world, tp=1)
    res["data_state"] = load_checkpoint(actor2, path)
    res["lp_loaded"] = actor2.compute_logprobs(probe)[0]
    res["steps_loaded"] = actor2.steps_done
    # Qwen3-MoE: EP=2 vs EP=1 (both DP=2; alltoall dispatcher)
    for ep in (1, 2):
        res[f"moe_ep{ep}"] = _moe_procedure(H.build_actor(world, ep=ep, spec=H.qwen3_moe_spec()))
    return res if rank == 0 else {}


def _moe_procedure(actor) -> dict:
    """Log-probs, one mini-batch forward+backward (loss, grads) and one optimizer step."""
    samples = H.make_samples()
    out = {"lp": actor.compute_logprobs(samples)[0]}
    plans, _, _ = actor.plan(samples)
    rows: list = [None] * dist.get_world_size()  # [rank][all micro-batches] packed row lengths
    dist.all_gather_object(rows, [int(mb.tokens.numel()) for p in plans for mb in p.micro_batches])
    out["row_lens"] = rows
    actor.old_logprobs.fill(samples, plans)
    ctx = actor.forward_backward(samples, plans[0])
    out["first_dev"] = actor.old_logprobs.first_ratio_dev(samples, plans[0], ctx)
    out["loss"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
    out["grads"] = H.full_tensors(actor, grads=True)
    out["step"] = actor.optimizer_step(ctx)
    out["params"] = H.full_tensors(actor, grads=False)
    return out


LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "tp2dp2_distopt": dict(tp=2, dist_opt=True),
           "pp2dp2": dict(pp=2)}
DEFAULT_4 = ("tp2pp2", "tp2dp2_distopt")
SLOW_4 = ("pp2dp2",)


def _four_rank_worker(rank: int, world: int, names: tuple[str, ...]) -> dict:
    res = {name: _procedure(H.build_actor(world, **LAYOUTS[name])) for name in names}
    return res if rank == 0 else {}


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_workers(_reference_worker, 1)[0]


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> dict:
    return run_workers(_two_rank_worker, 2, str(tmp_path_factory.mktemp("ckpt")))[0]


@pytest.fixture(scope="module")
def four_rank() -> dict:
    return run_workers(_four_rank_worker, 4, DEFAULT_4)[0]


@pytest.fixture(scope="module")
def four_rank_slow() -> dict:
    return run_workers(_four_rank_worker, 4, SLOW_4)[0]


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


def _close_after_adam(a: dict, b: dict, *grads: dict, lr: float = 1e-2) -> None:
    """Parameters after Adam steps: tight where the gradient is informative.

    Adam divides by ``sqrt(v)``, so a gradient element of ~1e-9 whose last bits differ between
    layouts can move its parameter by up to ``lr`` either way, and small gradients' relative
    rounding differences are amplified to ~1e-5 (cpu-notes.md §2: 7.6e-5 with Adam,
    7.5e-9 with SGD). Elements whose reference gradient exceeds 1e-6 on every step must agree to
    1e-4 (a wrong gradient moves them by ~lr = 1e-2); the rest only within ``2·lr`` per step.
    """
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs()
        tiny = torch.zeros_like(diff, dtype=torch.bool)
        for g in grads:
            tiny |= g[k].abs() <= 1e-6
        zero = torch.zeros(1)
        informative, noise = torch.cat([diff[~tiny], zero]).max(), torch.cat([diff[tiny], zero]).max()
        assert informative <= 1e-4, (k, informative)
        assert noise <= 2 * lr * len(grads), (k, noise)


def _assert_matches(res: dict, ref: dict) -> None:
    for i, (x, y) in enumerate(zip(res["lp_before"], ref["lp_before"])):
        assert torch.allclose(x, y, atol=2e-6), i
    assert res["first_dev"] == 0.0
    for k in (0, 1):
        assert math.isclose(res[f"loss{k}"], ref[f"loss{k}"], rel_tol=1e-5, abs_tol=1e-6)
        _close(res[f"grads{k}"], ref[f"grads{k}"], atol=1e-6)
        assert math.isclose(res[f"step{k}"]["actor/grad_norm"], ref[f"step{k}"]["actor/grad_norm"],
                            rel_tol=1e-5)
    _close_after_adam(res["params"], ref["params"], ref["grads0"], ref["grads1"])
    for x, y in zip(res["lp_after"], ref["lp_after"]):
        assert torch.allclose(x, y, atol=1e-4)
    for k in ("actor/loss_mb0", "actor/loss_mb1", "actor/first_ratio_max_abs_dev"):
        assert math.isclose(res["train_step"][k], ref["train_step"][k], rel_tol=1e-4, abs_tol=1e-6), k


def test_reference_trains_and_first_ratio_is_one(reference):
    r = reference["qwen2"]
    assert r["first_dev"] == 0.0 and r["train_step"]["actor/first_ratio_max_abs_dev"] == 0.0
    assert r["step0"]["actor/step_skipped"] == 0.0 and r["step0"]["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(r["lp_before"], r["lp_after"]))
    assert r["loss1"] != r["loss0"]


def test_overlong_and_empty_are_counted(reference):
    m = reference["robust"]
    assert m["actor/empty"] == 2.0  # the empty response and the budget-filling prompt
    n_cut, tokens_cut = reference["robust_expected"]
    assert n_cut == 2 and m["actor/truncated"] == n_cut and m["actor/truncated_tokens"] == tokens_cut
    assert math.isfinite(m["actor/loss"]) and m["actor/steps_skipped"] == 0.0


def test_tp2_matches_reference(reference, two_rank):
    _assert_matches(two_rank["tp2"], reference["qwen2"])


def test_nan_gradient_on_one_rank_skips_step_everywhere(two_rank):
    n = two_rank["nan"]
    assert n["skipped"] == 2.0 and n["params_equal"] and n["opt_equal"]
    assert n["steps_done"] == 4  # 2 by hand + 2 in train_step; the NaN step added none


def test_checkpoint_tp2_loads_at_tp1(two_rank):
    assert two_rank["ckpt_dirs"] == ["step_2"]
    assert two_rank["spec_record"]["layer_spec"] == "local" and "megatron_core" in two_rank["spec_record"]
    assert two_rank["data_state"] == {"epoch": 1, "cursor": 7}
    assert two_rank["steps_loaded"] == 4
    for x, y in zip(two_rank["lp_saved"], two_rank["lp_loaded"]):
        assert torch.allclose(x, y, atol=1e-6)


def test_moe_ep2_matches_ep1(two_rank):
    r1, r2 = two_rank["moe_ep1"], two_rank["moe_ep2"]
    assert r1["first_dev"] == 0.0 and r2["first_dev"] == 0.0
    # the default alltoall dispatcher needs no padding: EP=2 packs exactly as EP=1 (the allgather
    # dispatcher's padding is covered by test_moe_dispatch.py)
    assert r1["row_lens"][0] != r1["row_lens"][1]
    assert r2["row_lens"] == r1["row_lens"]
    for x, y in zip(r2["lp"], r1["lp"]):
        assert torch.allclose(x, y, atol=2e-6)
    assert math.isclose(r2["loss"], r1["loss"], rel_tol=1e-5, abs_tol=1e-6)
    assert any("local_experts.3." in k for k in r2["grads"])
    _close(r2["grads"], r1["grads"], atol=1e-6)
    assert r2["step"]["actor/step_skipped"] == 0.0
    assert math.isclose(r2["step"]["actor/grad_norm"], r1["step"]["actor/grad_norm"], rel_tol=1e-5)
    _close_after_adam(r2["params"], r1["params"], r1["grads"])


@pytest.mark.parametrize("layout", DEFAULT_4)
def test_four_rank_layouts_match_reference(reference, four_rank, layout):
    _assert_matches(four_rank[layout], reference["qwen2"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_4)
def test_four_rank_layouts_match_reference_slow(reference, four_rank_slow, layout):
    _assert_matches(four_rank_slow[layout], reference["qwen2"])
