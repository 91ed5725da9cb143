"""StateOffloader on plain modules and a torch optimizer: storages freed and restored bit for bit,
views stay valid, categories never double-claim a storage, host buffers are reused."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_maspo.train.actor.offload import (
    CATEGORIES,
    StateOffloader,
    offload_categories,
    training_tensors,
)


def _model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return m, opt


def test_roundtrip_frees_and_restores_every_enabled_storage():
    m, opt = _model_and_opt()
    view = m[0].weight[:2]  # a view must see the restored values, not a stale copy
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = [v.clone() for st in opt.state.values() for v in st.values()]
    off = StateOffloader(functools.partial(training_tensors, [m], opt), enabled=CATEGORIES)
    moved = off.offload()
    assert moved == sum(off.bytes_by_category.values()) > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    assert off.offload() == 0  # idempotent while offloaded
    assert off.reload() == moved
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(state, [v for st in opt.state.values() for v in st.values()]))
    assert torch.equal(view, before["0.weight"][:2])
    hosts = [id(t) for ts in off._pool.values() for t in ts]
    off.offload()
    assert sorted(id(s.host) for s in off._slots) == sorted(hosts), "host buffers must be reused"
    off.reload()


def test_optimizer_category_does_not_take_the_model_parameters():
    m, opt = _model_and_opt()  # fp32: the optimizer's params ARE the model's
    off = StateOffloader(functools.partial(training_tensors, [m], opt), enabled=("optimizer",))
    off.offload()
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for st in opt.state.values() for v in st.values())
    off.reload()


def test_categories_and_validation():
    assert offload_categories(True, False, True) == ("params", "optimizer")
    with pytest.raises(ValueError, match="accepted"):
        StateOffloader(lambda: {}, enabled=("activations",))
    assert StateOffloader(lambda: {}, enabled=()).offload() == 0
