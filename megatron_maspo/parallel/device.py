"""The one device seam: is this process on CUDA (decided once), its device, and the CPU bench's shims.

Product code asks :func:`on_cuda` instead of calling ``torch.cuda.is_available()`` at each branch, so
one answer holds for the whole process (a CUDA probe can be slow, and a test bench that hides GPUs
does so in one place). :func:`install_cpu_bench` is the only way product code reaches
:mod:`megatron_maspo.parallel.cpu_compat`: on a machine with CUDA it installs nothing.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def on_cuda() -> bool:
    """Whether this process computes on CUDA (``torch.cuda.is_available()``, asked once)."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device this process computes on: the local CUDA device, else CPU."""
    if on_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def install_cpu_bench() -> tuple[str, ...]:
    """Install megatron-core's CPU shims (``cpu_compat``) when there is no CUDA; returns the active parts.

    Idempotent; a no-op returning ``()`` on a CUDA machine, so a GPU run never takes the shimmed paths.
    """
    if on_cuda():
        return ()
    from megatron_maspo.parallel.cpu_compat import (
        apply_cpu_compat,  # CPU only: patches torch.cuda.*
    )

    return apply_cpu_compat()
