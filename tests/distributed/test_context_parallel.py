"""Context-parallel packed attention (``packed_sdpa`` at cp = 2, gloo) == one process on the whole row.

Each rank holds chunks ``r`` and ``2cp-1-r`` of every sequence (padded to a multiple of ``2cp``); the
reference is the cp = 1 module on the unpadded row in the same process. Outputs and the gradients of
q, k and v (upstream gradient zero on the padding, as in the model, where padding reaches no loss)
must agree at every real token to 1e-5 relative, in fp32.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LENS = [10, 3, 17, 1, 600]  # none a multiple of 2cp = 4 but the padding makes them so; 600 > one query block


def _attention(cp: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_maspo.model.packed_attention import PackedSDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, context_parallel_size=cp, attention_dropout=0.0,
                            use_cpu_initialization=True)
    return PackedSDPAttention(cfg, 1, AttnMaskType.causal, "self")


def _worker(rank: int, world: int) -> dict:
    from megatron_maspo.model.packed_attention import build_packed_seq_params
    from megatron_maspo.parallel.context_parallel import cp_local_positions, cp_padded_length
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.actor.packing import cu_seqlens

    groups = init_parallel(cp=world, seed=3)
    cp = groups.cp
    g = torch.Generator().manual_seed(0)
    s = sum(LENS)
    q, k, v = (torch.randn(s, h, 8, generator=g, dtype=torch.float64).float() for h in (4, 2, 2))
    up = torch.randn(s, 32, generator=g)
    # the reference: the whole unpadded row in this process
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _attention(1)(*ref_in, None, packed_seq_params=build_packed_seq_params(cu_seqlens(LENS)))
    (ref * up).sum().backward()
    # the padded global row and this rank's share of it
    padded = [cp_padded_length(n, cp) for n in LENS]
    real = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_seqlens(padded)[:-1], LENS)])
    held = cp_local_positions(cu_seqlens(padded), cp, groups.cp_rank)  # [S_pad/cp] global rows
    where = torch.full((sum(padded),), -1, dtype=torch.long)
    where[real] = torch.arange(s)  # padded row -> unpadded row (-1 = padding)
    src = where[held]
    is_real = src >= 0

    def local(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(held.numel(), *x.shape[1:])
        out[is_real] = x[src[is_real]]
        return out

    cp_in = [local(x).requires_grad_() for x in (q, k, v)]
    out = _attention(cp)(*cp_in, None, packed_seq_params=build_packed_seq_params(cu_seqlens(padded)))
    (out * local(up)).sum().backward()
    return {"out": (out[is_real], ref[src[is_real]]),
            **{f"d{n}": (x.grad[is_real], r.grad[src[is_real]])
               for n, x, r in zip("qkv", cp_in, ref_in)},
            "rows": held.numel(), "row": sum(padded)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.parametrize("name", ["out", "dq", "dk", "dv"])
def test_cp2_packed_attention_matches_one_process(results, name):
    for rank, res in enumerate(results):
        got, ref = res[name]
        assert ref.abs().max() > 0
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, f"rank {rank} {name}: max relative error {err:.2e}"


def test_each_rank_holds_half_the_padded_row(results):
    assert [r["rows"] * 2 for r in results] == [results[0]["row"]] * 2
