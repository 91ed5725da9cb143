"""Streams and events for one thread's transfers beside another thread's compute, on every device.

The weight sender posts its bucket broadcasts on a stream of its own while its prefetch thread exports
and packs the next buckets on the default stream (``rollout/pool_sync.py::WeightSender``); the two are
ordered by events only, never by sharing a stream:

    packing stream (default)   pack bucket k into buffer b, record ``ready_k``
    send stream                wait ``ready_k``, broadcast bucket k, record ``sent_k``
    packing stream             before packing into b again: wait ``sent_k`` (a stream wait, not the host)

The same calls on three devices: CUDA streams and events; the GPU-semantics emulation's streams and
events (``MASPO_EMULATE_GPU=1``, :mod:`~.gpu_emulation`), where a stream that waits is held and the
device ops behind it block; and plain CPU, where collectives complete when they return, so there is no
stream (None) and nothing to wait for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from megatron_maspo.parallel import gpu_emulation as _emu
from megatron_maspo.parallel.device import on_cuda


def new_stream(name: str) -> Any:
    """A stream of its own on this process's GPU (the emulated GPU under the emulation); None on CPU."""
    if on_cuda():
        from megatron_maspo.parallel.comm import local_device

        return torch.cuda.Stream(device=local_device())
    if _emu.active():
        return _emu.Stream(f"the {name}")
    return None


@contextlib.contextmanager
def using(stream: Any) -> Iterator[None]:
    """Make ``stream`` (from :func:`new_stream`) the calling thread's current one for the block."""
    if stream is None:
        yield
    elif on_cuda():
        with torch.cuda.stream(stream):
            yield
    else:
        with _emu.stream(stream):
            yield


def record(stream: Any = None, device: torch.device | None = None) -> Any:
    """An event of the work queued so far on ``stream`` (default: the calling thread's current stream on
    ``device``); None on CPU, where that work has completed already."""
    if on_cuda():
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(device))
        return ev
    if _emu.active():
        return (stream if stream is not None else _emu.current_stream()).record_event()
    return None


def wait(event: Any, stream: Any = None, device: torch.device | None = None) -> None:
    """Make the work queued later on ``stream`` (default: the calling thread's current one on ``device``)
    wait for ``event``; the host does not wait. No-op for None."""
    if event is None:
        return
    if on_cuda():
        (stream if stream is not None else torch.cuda.current_stream(device)).wait_event(event)
    elif _emu.active():
        (stream if stream is not None else _emu.current_stream()).wait_event(event)


def synchronize(stream: Any) -> None:
    """Block the host until everything queued on ``stream`` has completed (no-op for None)."""
    if stream is not None:
        stream.synchronize()
