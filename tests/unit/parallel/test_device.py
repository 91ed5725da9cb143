"""``cpu_compat.compile_on_first_call``: torch.compile deferred to the first call, nothing else changed.

That ``device.import_megatron_core`` uses it (no Inductor imported by megatron-core on CPU) is checked in
``tests/unit/test_import_boundary.py``, which imports megatron-core anyway.
"""

from __future__ import annotations

import torch

from megatron_maspo.parallel.cpu_compat import compile_on_first_call


def test_compile_on_first_call_defers_and_then_compiles():
    real = torch.compile
    calls = []

    def backend(gm, example_inputs):  # counts compilations; runs the captured graph as it is
        calls.append(len(example_inputs))
        return gm.forward

    with compile_on_first_call():
        assert torch.compile is not real

        @torch.compile(backend=backend)
        def f(x):
            return x * 2 + 1

        g = torch.compile(lambda x: x - 1, backend=backend)
        module = torch.compile(torch.nn.Linear(2, 2), backend=backend)
    assert torch.compile is real  # only the block sees the wrapper
    assert calls == [] and f.__name__ == "f"  # decorated, not compiled yet
    x = torch.arange(3.0)
    assert torch.equal(f(x), x * 2 + 1) and torch.equal(g(x), x - 1)
    assert len(calls) == 2  # each compiled at its first call, as torch.compile does
    f(x)
    assert len(calls) == 2  # and once
    assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule)  # modules: compiled as usual

