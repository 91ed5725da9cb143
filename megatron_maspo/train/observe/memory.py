"""Peak memory per phase of the RL step (generate, grade, old_logprobs, train, sync) as ``memory/*`` metrics.

On GPU each phase resets the caching allocator's peak statistics on entry and reads them on exit:
``memory/<phase>_peak_alloc_gb`` (tensors) and ``memory/<phase>_peak_reserved_gb`` (allocator
cache, what an OOM is measured against). On every device the host side is logged too:
``memory/<phase>_peak_rss_gb`` (the kernel's high-water mark, reset per phase through
``/proc/self/clear_refs`` on Linux; where that is not possible, the process-lifetime peak from
``getrusage``) and ``memory/<phase>_rss_gb`` (resident set at the end of the phase). Offloaded
host buffers show up there.

Phases are exclusive: a phase entered inside another (``old_logprobs`` inside ``train``) is
attributed to itself only; the outer one's peak covers its own parts before and after. A phase
entered several times in one step (dynamic sampling rounds) reports its maximum. The figures are
this rank's (rank 0 logs them, which also hosts the engine).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_maspo.parallel.device import on_cuda

GB = float(1 << 30)
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import psutil  # not Linux: psutil is a transformers/accelerate dependency in practice

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """High-water mark of the resident set since the last :func:`reset_peak_rss` (or process start)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0); False if unsupported."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    """Collects per-phase memory peaks for one step; :meth:`pop_metrics` hands them over and clears them.

    Args:
        device: the compute device; GPU figures are taken when it is a CUDA device.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.device = dev if dev.type == "cuda" and on_cuda() else None
        self._metrics: dict[str, float] = {}
        self._stack: list[dict[str, int]] = []  # running peaks of the open phases, outermost first

    def _peaks(self) -> dict[str, int]:
        out = {"peak_rss": peak_rss_bytes()}
        if self.device is not None:
            out["peak_alloc"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return out

    def _reset(self) -> None:
        reset_peak_rss()
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the body as phase ``name`` (re-entrant across steps, nestable)."""
        if self._stack:  # the enclosing phase keeps what it reached so far
            outer = self._stack[-1]
            for k, v in self._peaks().items():
                outer[k] = max(outer.get(k, 0), v)
        self._reset()
        self._stack.append({})
        try:
            yield
        finally:
            running = self._stack.pop()
            peaks = {k: max(running.get(k, 0), v) for k, v in self._peaks().items()}
            self._record(name, peaks)
            self._reset()  # the enclosing phase continues from here, without this phase's peak

    def _record(self, name: str, peaks: dict[str, int]) -> None:
        vals = {f"memory/{name}_{k}_gb": v / GB for k, v in peaks.items()}
        vals[f"memory/{name}_rss_gb"] = current_rss_bytes() / GB
        for k, v in vals.items():
            self._metrics[k] = max(self._metrics.get(k, 0.0), v)

    def pop_metrics(self) -> dict[str, float]:
        """The ``memory/*`` figures gathered since the last call."""
        out, self._metrics = self._metrics, {}
        return out
