"""Make megatron-core's CUDA-assuming calls work on a CPU-only torch with gloo.

megatron-core 0.16.1 runs GPTModel, the pipeline schedules, DDP, the optimizers and dist-checkpointing over
gloo once a handful of CUDA calls are redirected (docs/cpu-notes.md §1). Each part below is
independent and idempotent; :func:`apply_cpu_compat` installs them only when CUDA is absent, so a GPU run
never takes these paths.

Parts:
    rng      CPU RNG tracker with Megatron's API (``model_parallel_cuda_manual_seed`` works).
    dev      ``torch.cuda.current_device()`` -> CPU device (Megatron passes it as ``device=``).
    sync     no-op synchronize / streams / events.
    mode     a TorchFunctionMode that redirects ``device="cuda"`` factories and ``.cuda()`` to CPU.
             ``Tensor.type()`` is spoofed to ``torch.cuda.*`` only inside :func:`spoof_tensor_type`
             (Megatron's optimizers assert on it); off elsewhere so it cannot hide a GPU path.
    spoof    Megatron's optimizer methods that assert ``torch.cuda.*`` type strings (construction,
             ``step``, and the checkpoint methods) run inside :func:`spoof_tensor_type`, so product
             code never needs the spoof itself.
    rngfns   CUDA RNG-state functions -> CPU ones (activation recompute saves/restores them).
    a2a      ``all_to_all_single`` accepts split sizes given as tensors (Megatron's alltoall MoE
             dispatcher keeps them as host tensors when they are already on CPU; the CPU build's
             binding takes only lists/arrays). Gloo implements all-to-all-v itself: nothing is
             emulated, the sizes are only converted to lists.

Not a part: :func:`compile_on_first_call`, a context in which megatron-core is imported (see
``device.import_megatron_core``), so that its ``torch.compile``-decorated fused kernels compile on their
first call rather than importing TorchDynamo and Inductor while the decorators run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

ALL_PARTS = ("rng", "dev", "sync", "mode", "rngfns", "a2a", "spoof")
_applied: set[str] = set()
_mode: _CudaToCpuMode | None = None
_spoof = threading.local()


def _cpu_if_cuda(d: Any) -> Any:
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, int) and not isinstance(d, bool):
        # A bare integer device index means a CUDA ordinal in Megatron code (current_device()).
        return torch.device("cpu")
    return d


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA placements to CPU. Thread-local, like every TorchFunctionMode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu_if_cuda(a) if not isinstance(a, torch.Tensor) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and getattr(_spoof, "on", False):
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _DummyStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *a: Any, **k: Any) -> None: ...
    def wait_event(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, *a: Any, **k: Any) -> _DummyEvent:
        return _DummyEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> _DummyStream:
        return self

    def __exit__(self, *exc: Any) -> None: ...


class _DummyEvent(_DummyStream):
    def record(self, *a: Any, **k: Any) -> None: ...
    def elapsed_time(self, *a: Any, **k: Any) -> float:
        return 0.0


def _apply_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_maspo_cpu", False):
        return

    class CPURNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker keeping CPU generator states instead of CUDA ones."""

        _maspo_cpu = True

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _apply_dev() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    # megatron-core 0.16.1 without TE never defines moe_utils.te_general_gemm, so the MoE router's
    # `if te_general_gemm is not None` raises NameError; define the "absent" value it expects.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _apply_sync() -> None:
    noop = lambda *a, **k: None  # noqa: E731
    torch.cuda.synchronize = noop  # type: ignore[assignment]
    torch.cuda.set_stream = noop  # type: ignore[assignment]
    torch.cuda.empty_cache = noop  # type: ignore[assignment]
    torch.cuda.Stream = _DummyStream  # type: ignore[assignment, misc]
    torch.cuda.Event = _DummyEvent  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]


def _apply_mode() -> None:
    global _mode
    _mode = _CudaToCpuMode()
    _mode.__enter__()  # entered once and left on for the life of the process (this thread)


def _apply_rngfns() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]


def _split_list(sizes: Any) -> Any:
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


def _apply_a2a() -> None:
    import torch.distributed as dist

    orig = dist.all_to_all_single
    if getattr(orig, "_maspo_cpu", False):
        return

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return orig(output, input, _split_list(output_split_sizes), _split_list(input_split_sizes),
                    group=group, async_op=async_op)

    all_to_all_single._maspo_cpu = True  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single  # Megatron looks it up on the module at call time


# Megatron optimizer methods whose bodies compare ``Tensor.type()`` with ``torch.cuda.*`` names
# (megatron/core/optimizer/{optimizer,distrib_optimizer,clip_grads}.py), directly or through a callee.
_SPOOFED_METHODS = ("__init__", "step", "sharded_state_dict", "load_state_dict",
                    "_init_optimizer_states_with_dummy_values")


def _spoofed(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with spoof_tensor_type():
            return fn(*args, **kwargs)

    wrapper._maspo_cpu = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", "spoofed")
    return wrapper


def _apply_spoof() -> None:
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = [optimizer.MegatronOptimizer, optimizer.MixedPrecisionOptimizer,
               optimizer.Float16OptimizerWithFloat16Params, optimizer.FP32Optimizer,
               optimizer.ChainedOptimizer, distrib_optimizer.DistributedOptimizer]
    for cls in classes:
        for name in _SPOOFED_METHODS:
            fn = cls.__dict__.get(name)  # only what the class itself defines; subclasses wrap their own
            if callable(fn) and not getattr(fn, "_maspo_cpu", False):
                setattr(cls, name, _spoofed(fn))


_PARTS = {
    "rng": _apply_rng,
    "dev": _apply_dev,
    "sync": _apply_sync,
    "mode": _apply_mode,
    "rngfns": _apply_rngfns,
    "a2a": _apply_a2a,
    "spoof": _apply_spoof,
}


def apply_cpu_compat(parts: tuple[str, ...] = ALL_PARTS) -> tuple[str, ...]:
    """Install the CPU shims named in ``parts`` if CUDA is absent; return the parts now active.

    Call after ``torch.distributed`` is initialised and before models are built. A no-op on a
    machine with CUDA (returns ``()``), so callers need no branch.

    Raises:
        ValueError: an unknown part name.
    """
    unknown = set(parts) - set(ALL_PARTS)
    if unknown:
        raise ValueError(f"unknown cpu_compat parts {sorted(unknown)}; accepted: {list(ALL_PARTS)}")
    if torch.cuda.is_available():
        return ()
    for p in parts:
        if p not in _applied:
            _PARTS[p]()
            _applied.add(p)
    logger.debug("cpu_compat active parts: %s", sorted(_applied))
    return tuple(sorted(_applied))


@contextlib.contextmanager
def spoof_tensor_type():
    """Within this block, ``Tensor.type()`` reports ``torch.cuda.*`` (Megatron optimizer asserts).

    Only effective when the ``mode`` part is active; confined to the calling thread.
    """
    prev = getattr(_spoof, "on", False)
    _spoof.on = True
    try:
        yield
    finally:
        _spoof.on = prev


def active_parts() -> tuple[str, ...]:
    """The shim parts installed in this process."""
    return tuple(sorted(_applied))


@contextlib.contextmanager
def compile_on_first_call() -> Iterator[None]:
    """Within the block, ``torch.compile(fn)`` returns ``fn`` wrapped to compile itself on its first call.

    megatron-core decorates some forty fused kernels with ``torch.compile`` (``megatron.core.jit``) while
    its modules are imported, and the decoration alone imports TorchDynamo and Inductor: about 1.3 s of
    CPU in every process that imports megatron-core, a cost the CPU bench pays in each spawned rank
    and ``maspo train`` run. ``torch.compile`` compiles at the first call anyway, so deferring the
    wrapping changes nothing a call sees; modules (``nn.Module``) are compiled as usual. Only the
    block sees the wrapper: ``torch.compile`` is the real one again after it.
    """
    real = torch.compile

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): a decorator factory
            return lambda fn: deferred(fn, **options)
        if isinstance(model, torch.nn.Module):
            return real(model, **options)
        compiled: Callable | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real
