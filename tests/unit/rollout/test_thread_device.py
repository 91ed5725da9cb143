"""The sync's helper thread runs on the caller's GPU, not on GPU 0 (issue 29, defect 4).

A new Python thread's current CUDA device is 0 whatever its parent bound, so before the fix the
prefetch thread exported (PP manifest ``all_gather_object``, TP gathers) and synced streams on ``cuda:0``
of every rank. The device is data here: computed in the calling thread and bound in the helper; CUDA
calls are replaced by recorders so the test runs on CPU.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from megatron_maspo.parallel import comm, device
from megatron_maspo.rollout import transport


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available', the calling thread on device 5, and every set_device recorded with its thread."""
    calls: list[tuple[str, torch.device]] = []
    for module in (transport, comm):  # the device seam (parallel/device.py::on_cuda) as these modules see it
        monkeypatch.setattr(module, "on_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, torch.device(d))))
    return calls


def test_caller_device_is_the_calling_threads(fake_cuda):
    assert transport.caller_device() == torch.device("cuda", 5)


def test_prefetch_thread_binds_the_callers_device(fake_cuda):
    assert list(transport.prefetch(iter(range(4)))) == [0, 1, 2, 3]
    assert fake_cuda == [("maspo-bucket-prefetch", torch.device("cuda", 5))]


def test_prefetch_thread_binds_an_explicit_device(fake_cuda):
    list(transport.prefetch(iter(range(2)), device=torch.device("cuda", 3)))
    assert fake_cuda == [("maspo-bucket-prefetch", torch.device("cuda", 3))]


def test_prefetch_binds_nothing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device on a CPU box"))
    assert transport.caller_device() is None or device.on_cuda()
    assert list(transport.prefetch(iter([1, 2]), device=None)) == [1, 2]


def test_object_collectives_stage_on_the_bound_device_from_any_thread(fake_cuda, monkeypatch):
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device_ctx(d):
        entered.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device_ctx)
    monkeypatch.setattr(comm, "_bound", torch.device("cuda", 2))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a fresh thread's view
    assert comm.local_device() == torch.device("cuda", 2)
    with comm._on_local_device():
        pass
    with comm._on_local_device(torch.device("cuda", 6)):  # an explicit device wins (the manifest's)
        pass
    with comm._on_local_device(torch.device("cpu")):  # a CPU tensor's device: the bound GPU
        pass
    assert entered == [torch.device("cuda", 2), torch.device("cuda", 6), torch.device("cuda", 2)]
