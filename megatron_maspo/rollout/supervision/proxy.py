"""An engine that lives in a supervised process of its own, seen from the rollout pool as a plain engine.

The rollout pool's owner rank keeps its weight receiver, its grader and its place in the pool's
collectives; only the engine moves out, into a child process under an :class:`EngineSupervisor`. The
engine is the part that runs out of memory, hits a device error or hangs, and the owner rank is the
part that takes part in collectives with other ranks. So an engine failure becomes a restart inside
the owner (this engine's chunk is generated again, with the same seeds and weights) instead of the end
of the job.

    owner rank (torchrun)                              engine process (spawned, epoch n)
    WeightReceiver -> SupervisedEngine.load_buckets -> supervisor.load_weights -> BuiltinEngine
      crc32 + the trainer's digests, checked here       re-packed, digested, checked again there
    EngineShard.generate -> SupervisedEngine.generate -> chunks -> generate(first_prompt = chunk start)

Two checks, each end to end on its own hop: the received tensors are digested here against the
trainer's export before anything is forwarded, and the engine process checks what it holds against
digests of exactly these tensors (every tensor in full after a restart). In-flight updates are refused
(a chunk is made by one version; ``rollout/config.py``). An engine with worker processes of its own (vLLM)
starts them inside the engine process's group, which a restart ends whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import Bucket, unpack_stream
from megatron_maspo.rollout.supervision.engine_process import EngineLaunch
from megatron_maspo.rollout.supervision.supervisor import EngineSupervisor
from megatron_maspo.rollout.types import Completion, SamplingParams


class SupervisedEngine:
    """The :class:`~megatron_maspo.rollout.types.Engine` interface over one supervised engine process.

    Args:
        supervisor: an :class:`EngineSupervisor` of one engine, not started yet.
        label: names the engine in errors (``"builtin engine 0"``).
        chunks: chunks each ``generate`` call is split into (less work lost per failure; each chunk is
            still one batch of an engine); 0 = one per engine of the supervisor at the time.
    """

    takes_weights_between_steps = False

    def __init__(self, supervisor: EngineSupervisor, *, label: str, chunks: int = 0) -> None:
        self.supervisor, self.label, self.chunks = supervisor, label, chunks
        self.device = torch.device("cpu")
        """Where the owner's receiver stages a sync (host buffers: they are forwarded over a pipe)."""
        self.verify_s = 0.0
        self.verify_full_s: float | None = None
        self.defer_verify = False
        """Ignored: both checks run inside :meth:`load_buckets`."""
        self._loads = 0
        supervisor.start()

    @classmethod
    def from_settings(cls, rollout: Any, model: Any, spec: Any, *, seed: int, deterministic: bool,
                      engine_id: int, label: str, gpus: tuple[int, ...] | None = None) -> SupervisedEngine:
        """The supervised engine of a rollout-pool owner (``rollout.supervise_engines``) on ``gpus`` (the
        fleet layout's; None = the default device)."""
        launch = EngineLaunch(engine=engine_id, epoch=0, rollout=rollout, model=model, spec=spec, seed=seed,
                              deterministic=deterministic, gpus=gpus, threads=torch.get_num_threads())
        sup = EngineSupervisor(launch, 1, timeout_s=rollout.engine_timeout_s,
                               start_timeout_s=rollout.engine_start_timeout_s,
                               max_restarts=rollout.max_engine_restarts,
                               verify_every=rollout.verify_every_resolved, bucket_mb=rollout.bucket_mb,
                               first_engine=engine_id)  # log lines name the pool's engine id
        return cls(sup, label=label, chunks=rollout.supervised_chunks)

    @property
    def policy_version(self) -> int:
        return self._loads

    def bucket_pool(self, bucket_bytes: int) -> None:
        return None

    def staging_pool(self) -> None:
        return None

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        """Check the sync here (crc32 when ``verify``, then the trainer's digests), then have the engine
        process load and check it.

        Raises:
            WeightVerifyError: the received tensors, or what the engine holds, differ from the export.
        """
        t0 = time.perf_counter()
        expected = digest.Expected()
        named = [(n, t.clone()) for n, t in unpack_stream(expected.watch(buckets), verify=verify)]
        if expected.digests:
            by_name = dict(named)
            names = [n for n in expected.digests if n in by_name]
            held = dict(zip(names, digest.read(digest.digest(by_name[n], digest.Spec(*expected.digests[n][:2]))
                                              for n in names)))
            digest.compare(expected.digests, held, engine=f"{self.label} (received by its supervisor)",
                           version=self._loads + 1)
        self.supervisor.load_weights(named, self._loads + 1)
        self._loads += 1
        self.verify_s = time.perf_counter() - t0
        if expected.digests and all(v[0] == 1 for v in expected.digests.values()):
            self.verify_full_s = self.verify_s

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.supervisor.load_weights(list(weights), self._loads + 1)
        self._loads += 1

    def deferred_check(self) -> None:
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None,
                 on_step: Callable[[], object] | None = None) -> list[list[Completion]]:
        """``params.n`` completions per prompt, made in the engine process (re-made after a failure).

        Raises:
            ValueError: ``on_step`` is given (in-flight updates are not supervised).
        """
        if on_step is not None:
            raise ValueError("a supervised engine takes no weights in the middle of a generation")
        out = self.supervisor.generate(prompts, params, num_chunks=self.chunks or None)
        if progress is not None:
            progress(len(prompts) * params.n)
        return out

    def metrics(self) -> dict[str, float]:
        """The supervisor's ``rollout/*`` fault figures since the last call (:meth:`EngineSupervisor.metrics`)."""
        return self.supervisor.metrics()

    def sleep(self, level: int = 1) -> None:
        """Nothing to release: the engine never shares a device with a trainer here."""

    def wake_up(self, tags: Any = None) -> None:
        """See :meth:`sleep`."""

    def inject_fault(self, kind: str, name: str | None = None) -> None:
        raise NotImplementedError("weight-fault injection (MASPO_FAULT kind=flip_weight|stale_weight) is not "
                                  "wired through a supervised engine")

    def shutdown(self) -> None:
        """Stop the engine process (nothing keeps running)."""
        self.supervisor.close()
