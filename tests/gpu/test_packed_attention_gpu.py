"""GPU checks of the attention backends through the actor (bf16): packed SDPA (flash kernels) against
the dense block-causal mask, the varlen kernel (attention_backend="varlen") against packed SDPA, and the
Transformer Engine path (thd PackedSeqParams; sequence parallelism
at TP 2) against packed SDPA. Not run on the CPU machine this project is developed on."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(world: int, backend: str, tp: int) -> dict:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    cfg = H.make_cfg(world, tp, budget=72)
    cfg.model.attention_backend = backend
    cfg.model.bf16 = True
    spec = H.qwen2_spec()
    groups = init_parallel(tp=tp, seed=11)
    actor = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    samples = H.make_samples()
    plans, _, _ = actor.plan(samples)
    out = {"lp": actor.compute_logprobs(samples)[0],
           "rows": [int(mb.tokens.numel()) for p in plans for mb in p.micro_batches]}
    actor.old_logprobs.fill(samples, plans)
    ctx = actor.forward_backward(samples, plans[0])
    out["loss"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
    out["grads"] = H.full_tensors(actor, grads=True)
    return out


def _worker(rank: int, world: int, backends: tuple[str, ...], tp: int) -> dict:
    res = {b: _run(world, b, tp) for b in backends}
    return res if rank == 0 else {}


def _close(a: dict, b: dict, tol: float) -> None:
    for x, y in zip(a["lp"], b["lp"]):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)
    assert abs(a["loss"] - b["loss"]) <= tol * max(1.0, abs(b["loss"]))
    common = a["grads"].keys() & b["grads"].keys()  # TE fuses the norms into its linears: other names
    assert "embedding.word_embeddings.weight" in common and len(common) >= len(b["grads"]) // 2
    for name in common:
        g = b["grads"][name]
        err = (a["grads"][name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err < 0.1, f"{name}: relative gradient difference {err:.2e}"


def test_packed_sdpa_matches_dense_mask_on_gpu():
    res = run_workers(_worker, 1, ("dense_mask", "packed_sdpa"), 1, backend="nccl")[0]
    _close(res["packed_sdpa"], res["dense_mask"], tol=3e-2)  # bf16 kernels, different summation order


@pytest.mark.te
def test_te_thd_matches_packed_sdpa_tp1():
    res = run_workers(_worker, 1, ("packed_sdpa", "te"), 1, backend="nccl")[0]
    _close(res["te"], res["packed_sdpa"], tol=3e-2)


@pytest.mark.te
def test_te_sequence_parallel_tp2_matches_packed_sdpa():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    res = run_workers(_worker, 2, ("packed_sdpa", "te"), 2, backend="nccl")[0]
    assert all(n % 2 == 0 for n in res["te"]["rows"])  # rows padded to a multiple of TP for SP
    _close(res["te"], res["packed_sdpa"], tol=3e-2)


def test_varlen_matches_packed_sdpa_on_gpu():
    """attention_backend='varlen' (one varlen flash call per layer) through the actor: written, not yet run."""
    res = run_workers(_worker, 1, ("packed_sdpa", "varlen"), 1, backend="nccl")[0]
    _close(res["varlen"], res["packed_sdpa"], tol=3e-2)


def test_varlen_kernel_takes_mla_head_dims_on_gpu():
    """DeepSeek-V3's MLA head dims (d_qk 192, d_v 128) through torch's varlen kernel (FlashAttention-2, which
    wants v at the query's head size): ``varlen_call`` pads v and the sliced output is per-sequence SDPA's."""
    import torch.nn.functional as F
    from torch.nn.attention.varlen import varlen_attn

    from megatron_maspo.model.varlen_attention import varlen_call

    g = torch.Generator(device="cuda").manual_seed(0)
    bounds = [0, 100, 101, 356]
    q, k = (torch.randn(356, 4, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(356, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    args, kw = varlen_call(q, k, v, cu, 255, scale=192 ** -0.5, causal=True, kernel=varlen_attn)
    got = varlen_attn(*args, **kw)[..., :128]
    want = torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True)
                      .transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
