"""The one device seam: is this process on CUDA (decided once), its device, and the CPU bench's shims.

Product code asks :func:`on_cuda` instead of calling ``torch.cuda.is_available()`` at each branch, so
one answer holds for the whole process (a CUDA probe can be slow, and a test bench that hides GPUs
does so in one place). :func:`install_cpu_bench` and :func:`import_megatron_core` are the only ways product code
reaches :mod:`megatron_maspo.parallel.cpu_compat`: on a machine with CUDA they install nothing.
"""

from __future__ import annotations

import functools
import sys

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


def import_megatron_core() -> None:
    """Import megatron-core (once). On the CPU bench its ``torch.compile``-decorated fused kernels compile
    on their first call instead of importing TorchDynamo and Inductor at import (``cpu_compat``'s
    ``compile_on_first_call``; 1.3 s per process). Entry points call this before anything imports
    megatron-core; one that does not only starts slower. With CUDA, a plain import.
    """
    if "megatron.core" in sys.modules:
        return
    if on_cuda():
        import megatron.core  # noqa: F401
        return
    from megatron_maspo.parallel.cpu_compat import compile_on_first_call

    with compile_on_first_call():
        import megatron.core  # noqa: F401
