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

Host memory: one slab per category, of exactly the bytes it holds (each storage at a 512-byte aligned
offset), pinned in place with ``cudaHostRegister``. ``torch.empty(..., pin_memory=True)`` would go through
torch's caching host allocator, which rounds every allocation up to a power of two (a 40 GiB optimizer
state would pin 64 GiB). Slabs are kept and reused while they are large enough.

Phase order (:data:`STEP_PHASES`, driven by :class:`Colocation`): the engine's KV cache is woken only
after the trainer's state has left the GPU, and the trainer's state comes back only after the engine
slept, so the memory the offload frees is the memory the KV cache gets. The gradients and optimizer state
leave *before* the engine's weights wake: the sync reads only the parameters, so the engine's weights
never share the GPU with the whole training state (the order NeMo-RL's Megatron worker uses before its
refit); the parameters leave after the sync:

    offload_trainer (params) -> wake_kv_cache -> generate -> sleep_engine -> reload_trainer -> train
        (-> checkpoint, when one is due: state resident, engine asleep)
        -> offload_state (grads, optimizer) -> wake_weights -> sync -> offload_trainer -> ...

A checkpoint therefore is written between the update and the sync, where the whole state is on the GPU
and the engine sleeps; one that could not be foreseen (a stop signal after the sync) first puts the
engine to sleep and reloads the state (:meth:`Colocation.make_resident`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.parallel.offload_categories import CATEGORIES as CATEGORIES
from megatron_maspo.parallel.offload_categories import offload_categories as offload_categories

logger = logging.getLogger(__name__)

HOST_ALIGN = 512
"""Byte alignment of each storage inside a category's host slab."""


def release_cached_memory() -> None:
    """Drop unreachable Python objects and return the CUDA caching allocator's free blocks to the driver.

    Called between phases (after training, before the engine wakes or allocates its KV cache), so
    the next phase can use memory the previous one only held in cache. A no-op beyond ``gc`` on CPU.
    """
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()


def freeze_long_lived_objects() -> None:
    """Collect once, then take every surviving object out of the cyclic collector's reach (``gc.freeze``).

    Called once the components are built. Imports of torch, megatron-core and transformers leave millions
    of long-lived objects; without this, every :func:`release_cached_memory` between phases (and each of
    Python's own full collections) walks all of them again: 0.4 s per call on CPU even for the tiny
    model. Frozen objects are still freed by reference counting; only a cycle among them would outlive
    its last use, and the model, optimizer and engine live for the whole run anyway.
    """
    gc.collect()
    gc.freeze()


def unfreeze_long_lived_objects() -> None:
    """Undo :func:`freeze_long_lived_objects` at the end of a run, so the interpreter's exit collects
    those objects as usual (triton's bindings list every object still alive then as a leak)."""
    gc.unfreeze()


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


def _aligned(n: int) -> int:
    return (n + HOST_ALIGN - 1) // HOST_ALIGN * HOST_ALIGN


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place (``cudaHostRegister``, portable: as torch's own
    ``torch/cuda/_pin_memory_utils.py`` does for checkpoint staging); False (and a warning) if CUDA refuses."""
    cudart: Any = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1)
    if int(err) != 0:
        logger.warning("offload: cudaHostRegister of %d bytes failed (%s); copies will be synchronous",
                       t.numel(), err)
        return False
    return True


def _host_unregister(t: torch.Tensor) -> None:
    cudart: Any = torch.cuda.cudart()
    cudart.cudaHostUnregister(t.data_ptr())


class HostSlab:
    """``nbytes`` of host memory, exactly: allocated by the CPU allocator (no rounding) and, with ``pin``,
    page-locked in place, so device copies are asynchronous DMA; unpinned when the slab is collected."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = bool(pin and nbytes and _host_register(self.tensor))
        if self.pinned:
            weakref.finalize(self, _host_unregister, self.tensor)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


@dataclass
class StateOffloader:
    """Moves the enabled categories of a model's training state to host memory and back.

    Args:
        collect: returns :func:`training_tensors`-like lists; called at every :meth:`offload`, since
            optimizer state and fp32 grads appear lazily (after the first step).
        enabled: the categories to move (a subset of ``CATEGORIES``); empty = a no-op offloader.
        device: only storages on this device are moved (on GPU, CPU-side scalars such as Adam's
            ``step`` stay put).
        pin: page-lock the host slabs (default: when ``device`` is a GPU).
    """

    collect: Callable[[], dict[str, list[torch.Tensor]]]
    enabled: tuple[str, ...] = ()
    device: torch.device = torch.device("cpu")
    pin: bool | None = None
    offloaded: bool = False
    """Whether any category is on the host now (:attr:`offloaded_categories` says which)."""
    offloaded_categories: set[str] = field(default_factory=set)
    bytes_by_category: dict[str, int] = field(default_factory=dict)
    _slots: list[_Slot] = field(default_factory=list)
    _slabs: dict[str, HostSlab] = field(default_factory=dict)  # one per category, reused while large enough

    def __post_init__(self) -> None:
        bad = set(self.enabled) - set(CATEGORIES)
        if bad:
            raise ValueError(f"offload categories {sorted(bad)}; accepted: {list(CATEGORIES)}")
        self.device = torch.device(self.device)
        if self.pin is None:
            self.pin = self.device.type == "cuda"

    def _storages(self, want: set[str]) -> dict[str, list[torch.UntypedStorage]]:
        """Distinct resizable storages of each category of ``want`` on ``device``, in claim order (a
        storage is claimed by its first category whether or not that one is wanted)."""
        tensors = self.collect()
        claimed: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {}
        for cat in CATEGORIES:
            total = 0
            for t in tensors.get(cat, []):
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() == 0 or key in claimed or st.device != self.device:
                    continue
                claimed.add(key)
                if cat not in want:
                    continue
                if not st.resizable():  # e.g. a tensor over memory it does not own: cannot be freed
                    logger.warning("offload: a %s storage of %d bytes is not resizable; kept on %s",
                                   cat, st.nbytes(), self.device)
                    continue
                out.setdefault(cat, []).append(st)
                total += st.nbytes()
            if cat in want or cat not in self.enabled:
                self.bytes_by_category[cat] = total if cat in want else 0
        return out

    @property
    def nbytes(self) -> int:
        """Bytes moved by one :meth:`offload` (0 while the state is on the device)."""
        return sum(s.nbytes for s in self._slots)

    @property
    def host_nbytes(self) -> int:
        """Host memory the slabs hold (pinned on GPU): the offloaded bytes plus at most 511 bytes of
        alignment per storage, never a power-of-two rounding."""
        return sum(s.nbytes for s in self._slabs.values())

    def _slab(self, cat: str, need: int) -> HostSlab:
        slab = self._slabs.get(cat)
        if slab is None or slab.nbytes < need:
            self._slabs.pop(cat, None)  # unpin and free the old one before allocating the new one
            slab = self._slabs[cat] = HostSlab(need, bool(self.pin))
        return slab

    @property
    def fully_offloaded(self) -> bool:
        """Every enabled category is on the host."""
        return self.offloaded_categories >= set(self.enabled)

    def offload(self, categories: Iterable[str] | None = None) -> int:
        """Copy the storages of ``categories`` (None = every enabled one) that are still on the device to
        host memory and free them there; returns the bytes this call moved (0 when nothing was left)."""
        want = set(self.enabled if categories is None else categories) & set(self.enabled)
        want -= self.offloaded_categories
        if not want:
            return 0
        cuda = self.device.type == "cuda"
        new: list[_Slot] = []
        with torch.no_grad():
            for cat, storages in self._storages(want).items():
                sizes = [st.nbytes() for st in storages]
                slab = self._slab(cat, sum(_aligned(n) for n in sizes))
                offset = 0
                for st, n in zip(storages, sizes):
                    host = slab.tensor[offset:offset + n]
                    host.copy_(_bytes(st, n), non_blocking=slab.pinned)
                    new.append(_Slot(st, n, host))
                    offset += _aligned(n)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()
            for s in new:
                s.storage.resize_(0)
        self._slots += new
        self.offloaded_categories |= want
        self.offloaded = True
        release_cached_memory()
        return sum(s.nbytes for s in new)

    def reload(self) -> int:
        """Re-allocate every offloaded storage on the device and copy its bytes back; returns bytes moved."""
        if not self.offloaded:
            return 0
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            for s in self._slots:
                s.storage.resize_(s.nbytes)
                _bytes(s.storage, s.nbytes).copy_(s.host, non_blocking=cuda and bool(self.pin))
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()
        moved = self.nbytes
        self._slots = []  # the slabs stay: pinning is slow, the next step reuses them
        self.offloaded = False
        self.offloaded_categories = set()
        return moved


# --------------------------------------------------------------------------- colocation phase order
@dataclass(frozen=True)
class Phase:
    """One phase of a colocated step: what runs, and what occupies the GPU while (and after) it runs.

    ``resident`` names memory terms: ``trainer_kept`` (training state the offload leaves on the GPU),
    ``offloaded_state`` / ``offloaded_params`` (the gradients and optimizer state / the parameters that
    ``train.offload_*`` moves), ``engine_weights``, ``kv_cache`` (the engine's,
    sized when it started), ``activations`` (the update's activations and log-prob workspace),
    ``buckets`` (the sync's double-buffered buckets).
    """

    name: str
    does: str
    resident: frozenset[str]


def _phase(name: str, does: str, *resident: str) -> Phase:
    return Phase(name, does, frozenset(resident))


STEP_PHASES: tuple[Phase, ...] = (
    _phase("offload_trainer", "every rank: StateOffloader.offload(), then a barrier when an engine spans "
           "other ranks' GPUs", "trainer_kept", "engine_weights"),
    _phase("wake_kv_cache", "engine.wake_up(['kv_cache']): the KV cache (sized at engine start) is mapped "
           "into the memory the offload freed", "trainer_kept", "engine_weights", "kv_cache"),
    _phase("generate", "engine.generate (+ grading)", "trainer_kept", "engine_weights", "kv_cache"),
    _phase("sleep_engine", "engine.sleep(rollout.sleep_level): KV cache dropped, weights to host (1) or "
           "dropped (2); then a barrier when an engine spans other ranks' GPUs", "trainer_kept"),
    _phase("reload_trainer", "StateOffloader.reload()", "trainer_kept", "offloaded_params", "offloaded_state"),
    _phase("train", "old log-probs and the update (then a due checkpoint); cached blocks released after",
           "trainer_kept", "offloaded_params", "offloaded_state", "activations"),
    _phase("offload_state", "StateOffloader.offload(grads, optimizer): the sync reads only the parameters; "
           "then a barrier when an engine spans other ranks' GPUs", "trainer_kept", "offloaded_params"),
    _phase("wake_weights", "engine.wake_up(['weights'])", "trainer_kept", "offloaded_params", "engine_weights"),
    _phase("sync", "export -> buckets -> engine (evaluation comes after it)",
           "trainer_kept", "offloaded_params", "engine_weights", "buckets"),
)
"""One RL step of colocated training and generation, in order (the next step starts again at the top).
Read by :class:`Colocation` (which runs it), the planner and ``maspo check``."""


def phase_order() -> tuple[str, ...]:
    """The names of :data:`STEP_PHASES`, in order."""
    return tuple(p.name for p in STEP_PHASES)


def phase_peaks(sizes: Mapping[str, float]) -> dict[str, float]:
    """GPU memory per phase: the sum of ``sizes`` (bytes or GiB per resident term; missing = 0) over
    each phase's ``resident`` set, ``{phase name: total}``."""
    return {p.name: sum(float(sizes.get(k, 0.0)) for k in p.resident) for p in STEP_PHASES}


@dataclass
class Colocation:
    """Runs :data:`STEP_PHASES`: the engine's sleep / wake and the trainer's offload / reload, in order.

    Every rank calls every method at the same point of the step (``engine`` is None on ranks that own no
    engine). ``barrier`` (a collective over all ranks) is called where one rank's memory move must be done
    before another rank's engine touches the same GPU: only when an engine's workers use other ranks'
    GPUs (``spans_ranks``: vLLM TP > 1). Methods are idempotent within a step; :attr:`trace` records the
    phases that acted (tests).

    Args:
        offloader: the trainer's :class:`StateOffloader` (a no-op one without ``train.offload_*``).
        sleep_level: ``rollout.sleep_level``.
    """

    offloader: StateOffloader
    sleep_level: int = 2
    engine: Any = None
    spans_ranks: bool = False
    state_first: bool = True
    """Offload the gradients and optimizer state before the engine's weights wake (``offload_state``);
    False keeps them through the sync (no engine on these GPUs: the disaggregated trainers)."""
    barrier: Callable[[], None] = lambda: None
    trace: list[str] = field(default_factory=list)
    _engine_asleep: bool = False
    _kv_asleep: bool = False

    def _sync_ranks(self) -> None:
        if self.spans_ranks:
            self.barrier()

    def start_engine(self, build: Callable[[], Any] | None) -> Any:
        """Start the engine (``build()``; None on ranks without one) where the KV cache it sizes can use
        the offloaded memory: trainer offloaded while it starts, engine asleep and trainer back after.
        Without offload the engine simply starts (and stays awake, as before)."""
        if not self.offloader.enabled:
            self.engine = build() if build is not None else None
            return self.engine
        self.offloader.offload()
        self._sync_ranks()
        self.engine = build() if build is not None else None
        self._sync_ranks()
        self.prepare_update()
        return self.engine

    def prepare_generation(self) -> int:
        """offload_trainer -> wake_kv_cache; returns the bytes now offloaded (also when an earlier call of
        this step, e.g. before an evaluation, did the move)."""
        if self.offloader.enabled and not self.offloader.fully_offloaded:
            self.offloader.offload()
            self.trace.append("offload_trainer")
            self._sync_ranks()
        if self._kv_asleep:
            if self.engine is not None:
                self.engine.wake_up(["kv_cache"])
            self._kv_asleep = False
            self.trace.append("wake_kv_cache")
        return self.offloader.nbytes

    def make_resident(self) -> None:
        """Everything the trainer has back on the GPU, the engine asleep first (so the two never add up):
        for a checkpoint nobody could foresee (a stop signal after the sync). The engine's weights must be
        synced again before it generates (the loop stops after such a checkpoint)."""
        if self.offloader.offloaded:
            self.prepare_update()

    def prepare_update(self) -> None:
        """sleep_engine -> reload_trainer (after generation, before the old log-probs and the update)."""
        if not self._engine_asleep:
            if self.engine is not None:
                self.engine.sleep(self.sleep_level)
            self._engine_asleep = self._kv_asleep = True
            self.trace.append("sleep_engine")
            self._sync_ranks()
        if self.offloader.offloaded:
            self.offloader.reload()
            self.trace.append("reload_trainer")

    def prepare_sync(self) -> None:
        """offload_state -> wake_weights. The gradients and optimizer state (those of them ``train.offload_*``
        moves) leave first: the export reads only the parameters, which stay. Level 1 brings the kept
        weights back here; after level 2 the sync's load re-allocates them (``load_buckets`` /
        ``load_weights``). The KV cache stays asleep until :meth:`prepare_generation` has offloaded the
        parameters."""
        if "params" in self.offloader.offloaded_categories:
            raise RuntimeError("colocation: the trainer's parameters are offloaded; the sync needs them on the GPU")
        state = [c for c in STATE_CATEGORIES if c in self.offloader.enabled]
        if self.state_first and state and not self.offloader.offloaded_categories >= set(state):
            self.offloader.offload(state)
            self.trace.append("offload_state")
            self._sync_ranks()  # before an engine on this GPU (another rank's) wakes its weights
        if self._engine_asleep:
            if self.engine is not None and self.sleep_level == 1:
                self.engine.wake_up(["weights"])
            self._engine_asleep = False
            self.trace.append("wake_weights")


STATE_CATEGORIES = ("grads", "optimizer")
"""What ``offload_state`` moves before the sync (the export reads only ``params``)."""


def build_colocation(offloader: StateOffloader, rollout: Any, fleet: Any) -> Colocation:
    """The :class:`Colocation` of a run: ``rollout.sleep_level``, barriers over the world only when an
    engine's workers use other ranks' GPUs (``fleet.rollout_tp > 1``)."""
    return Colocation(offloader, sleep_level=rollout.sleep_level,
                      spans_ranks=fleet.rollout_tp > 1 and fleet.world > 1, barrier=comm.barrier)
