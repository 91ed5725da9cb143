"""fla's varlen gated-delta-rule kernel against the pure-torch packed path on CUDA: one packed row
of three unequal sequences, output and gradients of q, k, v, g, beta (bf16-level tolerance is not
needed: both run fp32 inputs). Needs CUDA and the ``gdn`` extra (flash-linear-attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_maspo.model import gdn_kernels

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or not gdn_kernels.fla_installed(),
                    reason="needs CUDA and flash-linear-attention (the gdn extra)")
def test_fla_matches_torch_on_packed_row():
    bounds = [0, 77, 80, 211]  # none a multiple of 64, one shorter than the conv kernel
    gen = torch.Generator().manual_seed(0)
    t, h, dk, dv = bounds[-1], 4, 64, 64
    cpu = [torch.randn(t, h, dk, generator=gen), torch.randn(t, h, dk, generator=gen),
           torch.randn(t, h, dv, generator=gen), -F.softplus(torch.randn(t, h, generator=gen)),
           torch.rand(t, h, generator=gen)]
    w = torch.randn(t, h, dv, generator=gen).cuda()
    outs, grads = {}, {}
    for backend in ("torch", "fla"):
        xs = [x.cuda().requires_grad_() for x in cpu]
        o = gdn_kernels.chunk_gated_delta_rule(*xs, bounds, backend=backend)
        outs[backend] = o.detach()
        grads[backend] = torch.autograd.grad((o.float() * w).sum(), xs)
    assert gdn_kernels.gdn_backend("auto", torch.device("cuda")) == "fla"
    assert (outs["fla"] - outs["torch"]).abs().max() < 2e-3 * outs["torch"].abs().max()
    for a, b in zip(grads["fla"], grads["torch"]):
        assert (a - b).abs().max() < 2e-3 * b.abs().max().clamp_min(1e-6)
