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
    slabs = {c: s.tensor.data_ptr() for c, s in off._slabs.items()}
    off.offload()
    assert {c: s.tensor.data_ptr() for c, s in off._slabs.items()} == slabs, "host slabs must be reused"
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


def test_host_memory_is_one_exact_slab_per_category_not_power_of_two(monkeypatch):
    """Pinned buffers from torch's caching host allocator round each allocation up to a power of two;
    the offloader pins one slab per category of exactly its bytes (+ 512-byte alignment) in place
    (cudaHostRegister, recorded here so the pinned path runs on CPU)."""
    from megatron_maspo.train.actor import offload as O

    registered: list[int] = []
    monkeypatch.setattr(O, "_host_register", lambda t: registered.append(t.numel()) or True)
    monkeypatch.setattr(O, "_host_unregister", lambda t: None)
    real_empty = torch.empty

    def no_caching_pin(*a, **kw):  # the caching host allocator must not be used
        assert not kw.get("pin_memory"), "pinned memory through the caching host allocator"
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", no_caching_pin)
    # 3 parameters of 1000 float32 (4000 bytes each) + their grads: 12,000 bytes of params, not 16 KiB
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(1000)
    off = StateOffloader(lambda: {"params": params, "grads": [p.grad for p in params], "optimizer": []},
                         enabled=CATEGORIES, pin=True)
    assert off.offload() == 24_000
    exact = 3 * (4000 + (-4000) % O.HOST_ALIGN)  # 3 x 4096
    assert registered == [exact, exact] and off.host_nbytes == 2 * exact == 24_576
    assert {c: s.nbytes for c, s in off._slabs.items()} == {"params": exact, "grads": exact}
    assert all(s.pinned for s in off._slabs.values())
    off.reload()
    off.offload()  # reused, nothing pinned again
    assert registered == [exact, exact]
    off.reload()
