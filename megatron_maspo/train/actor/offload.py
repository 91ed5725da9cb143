"""Training state to host memory during generation and back: parameters, gradients, optimizer state.

Colocated training and generation share a GPU: while the engine samples, the trainer's parameters,
gradient buffers and optimizer state (fp32 master copies, Adam moments) only occupy memory the KV
cache could use. :class:`StateOffloader` moves them out **storage by storage**: every tensor's
untyped storage is copied byte for byte into a (pinned, reused) host buffer and then resized to 0,
and on reload resized back and refilled. Resizing the storage instead of swapping ``param.data``
keeps every view valid: Megatron's DDP parameters and ``main_grad`` are views into flat
``param_data`` / ``grad_data`` buffers, and the distributed optimizer's shards are views too, so one
storage covers a whole buffer and nothing has to be re-wired. Restored state is bit-identical.

On CPU the same code runs (the "host" buffer is a second CPU buffer), which is how the tests check
it. A tensor must not be touched while offloaded (its storage is empty): the actor refuses to
train or export while :attr:`StateOffloader.offloaded` is set.

Categories are claimed in the order params → grads → optimizer: a storage already claimed by an
earlier category (fp32 training without master copies: the optimizer's params *are* the model's)
is never offloaded by a later one, whichever categories are enabled.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_maspo.parallel.device import on_cuda

logger = logging.getLogger(__name__)

CATEGORIES = ("params", "grads", "optimizer")


def release_cached_memory() -> None:
    """Drop unreachable Python objects and return the CUDA caching allocator's free blocks to the driver.

    Called between phases (after training, before the engine wakes or allocates its KV cache), so
    the next phase can use memory the previous one only held in cache. A no-op beyond ``gc`` on CPU.
    """
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers under Megatron's (chained / mixed-precision / distributed) wrappers."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def training_tensors(chunks: list, optimizer, extra_models: Iterable = ()) -> dict[str, list[torch.Tensor]]:
    """The tensors each category owns (views allowed: offload works on their storages).

    Args:
        chunks: the DDP-wrapped (or plain) model chunks.
        optimizer: Megatron's optimizer (or a torch optimizer); None for no optimizer.
        extra_models: further modules whose parameters count as ``params`` (a frozen reference model).

    Returns:
        ``{"params": [...], "grads": [...], "optimizer": [...]}``: model parameters; DDP grad buffers,
        ``main_grad`` views and ``.grad`` tensors (the optimizer's fp32 ones included); optimizer
        parameters (master copies) and state (Adam moments).
    """
    params = [p for m in [*chunks, *extra_models] for p in m.parameters()]
    grads: list[torch.Tensor] = []
    for c in chunks:
        # Megatron DDP's ``buffers`` is a list of flat param/grad buffers (it shadows ``Module.buffers``)
        for attr in ("buffers", "expert_parallel_buffers"):
            bufs = getattr(c, attr, None)
            for buf in bufs if isinstance(bufs, (list, tuple)) else ():
                if getattr(buf, "grad_data", None) is not None:
                    grads.append(buf.grad_data)
    grads += [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    opt: list[torch.Tensor] = []
    if optimizer is not None:
        for inner in _torch_optimizers(optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    opt.append(p)
                    if p.grad is not None:
                        grads.append(p.grad)
            for state in inner.state.values():
                opt += [v for v in state.values() if torch.is_tensor(v)]
    return {"params": params, "grads": grads, "optimizer": opt}


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor


def _bytes(storage: torch.UntypedStorage, n: int) -> torch.Tensor:
    """A ``[n]`` uint8 view over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


@dataclass
class StateOffloader:
    """Moves the enabled categories of a model's training state to host memory and back.

    Args:
        collect: returns :func:`training_tensors`-like lists; called at every :meth:`offload`, since
            optimizer state and fp32 grads appear lazily (after the first step).
        enabled: the categories to move (a subset of ``CATEGORIES``); empty = a no-op offloader.
        device: only storages on this device are moved (on GPU, CPU-side scalars such as Adam's
            ``step`` stay put).
    """

    collect: Callable[[], dict[str, list[torch.Tensor]]]
    enabled: tuple[str, ...] = ()
    device: torch.device = torch.device("cpu")
    offloaded: bool = False
    bytes_by_category: dict[str, int] = field(default_factory=dict)
    _slots: list[_Slot] = field(default_factory=list)
    _pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # host buffers by size, reused

    def __post_init__(self) -> None:
        bad = set(self.enabled) - set(CATEGORIES)
        if bad:
            raise ValueError(f"offload categories {sorted(bad)}; accepted: {list(CATEGORIES)}")
        self.device = torch.device(self.device)

    def _storages(self) -> list[torch.UntypedStorage]:
        """Distinct resizable storages of the enabled categories on ``device``, in claim order."""
        tensors = self.collect()
        claimed: set[int] = set()
        out: list[torch.UntypedStorage] = []
        for cat in CATEGORIES:
            total = 0
            for t in tensors.get(cat, []):
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() == 0 or key in claimed or st.device != self.device:
                    continue
                claimed.add(key)
                if cat not in self.enabled:
                    continue
                if not st.resizable():  # e.g. a tensor over memory it does not own: cannot be freed
                    logger.warning("offload: a %s storage of %d bytes is not resizable; kept on %s",
                                   cat, st.nbytes(), self.device)
                    continue
                out.append(st)
                total += st.nbytes()
            self.bytes_by_category[cat] = total if cat in self.enabled else 0
        return out

    @property
    def nbytes(self) -> int:
        """Bytes moved by one :meth:`offload`."""
        return sum(s.nbytes for s in self._slots)

    def offload(self) -> int:
        """Copy every enabled storage to host memory and free it on the device; returns bytes moved."""
        if self.offloaded or not self.enabled:
            return 0
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for st in self._storages():
                n = st.nbytes()
                free = self._pool.get(n)
                host = free.pop() if free else torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(st, n), non_blocking=pin)
                self._slots.append(_Slot(st, n, host))
            if pin:
                torch.cuda.current_stream(self.device).synchronize()
            for s in self._slots:
                s.storage.resize_(0)
        self.offloaded = True
        release_cached_memory()
        return self.nbytes

    def reload(self) -> int:
        """Re-allocate every offloaded storage on the device and copy its bytes back; returns bytes moved."""
        if not self.offloaded:
            return 0
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for s in self._slots:
                s.storage.resize_(s.nbytes)
                _bytes(s.storage, s.nbytes).copy_(s.host, non_blocking=pin)
            if pin:
                torch.cuda.current_stream(self.device).synchronize()
        moved = self.nbytes
        for s in self._slots:  # pinned buffers are slow to allocate: keep them for the next step
            self._pool.setdefault(s.nbytes, []).append(s.host)
        self._slots = []
        self.offloaded = False
        return moved


def offload_categories(params: bool, grads: bool, optimizer: bool) -> tuple[str, ...]:
    """The enabled categories, in claim order, from three switches (``train.offload_*``)."""
    return tuple(c for c, on in zip(CATEGORIES, (params, grads, optimizer)) if on)
