"""The built-in rollout engine: a transformers causal LM with KV-cache batched sampling (CPU default).

It receives weights exactly like the vLLM engine (``load_weights`` of full HF-named tensors from the same
bucketed resharding path), so every weight-sync test runs without a GPU. Generation is a plain loop:
left-padded prefill of all ``P·n`` rows, then one token per step with the KV cache, inverse-CDF sampling
with one seeded generator per row (``sampling.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import Bucket, unpack_stream
from megatron_maspo.rollout.fused_experts import fused_slot, pieces_per_fused
from megatron_maspo.rollout.hf_cache import forward_with_cache
from megatron_maspo.rollout.routing import RoutingRecorder
from megatron_maspo.rollout.sampling import sample_tokens, scaled_logprobs
from megatron_maspo.rollout.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003  # row seed = seed * stride**2 + prompt * stride + sample: distinct for any sane P, n



def synced_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight sync writes: parameters plus persistent floating buffers the checkpoint
    holds (``e_score_correction_bias``: state, not trained, but part of the policy's routing)."""
    out = dict(model.named_parameters())
    saved = model.state_dict(keep_vars=True).keys()
    out.update((n, b) for n, b in model.named_buffers() if n in saved and b.is_floating_point())
    return out

class BuiltinEngine:
    """Rollout engine over an in-process transformers model (implements :class:`~.types.Engine`).

    It takes new weights between two decode steps of a call (``generate(on_step=...)``: in-flight updates).

    Args:
        model: a transformers ``*ForCausalLM`` (fp32 recommended on CPU); put in eval mode here.
        device: where the model, its inputs and the sampling run (the model is moved there); None =
            where the model already is. :meth:`from_hf_config` defaults to :func:`default_engine_device`.
    """

    takes_weights_between_steps = True

    def __init__(self, model: Any, *, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self._version = 0
        self._asleep = 0
        self._sleeping: set[str] = set()  # vLLM's tags still asleep: "weights", "kv_cache"
        self._dropped: dict[str, torch.Size] = {}  # level-2 sleep: parameter shapes to re-allocate
        self.record_routing = False
        """MoE: report each completion's ``routed_experts`` (routing replay; ``rollout/routing.py``)."""
        self._recorder: RoutingRecorder | None = None  # gate hooks, attached on first use
        self.label = "builtin engine"
        """Names this engine in errors (the rollout pool sets ``builtin engine <id> (rank <r>)``)."""
        self.verify_s = 0.0
        """Seconds the last sync's digest verification took (0 when it was not verified)."""
        self.verify_full_s: float | None = None
        """Seconds of the last verification that digested every tensor in full (None before one)."""
        self._fault: tuple[str, str | None] | None = None  # inject_fault: applied after the next load
        self.defer_verify = False
        """``load_buckets`` leaves the digest check to :meth:`deferred_check` (the rollout pool runs it
        beside generation, so the engine loop pauses only for the copy-in)."""
        self._pending: tuple[dict, int] | None = None  # (expected digests, version) awaiting deferred_check

    @classmethod
    def from_settings(cls, rollout: Any, model: Any, spec: Any, *, seed: int, deterministic: bool = True,
                      gpus: tuple[int, ...] | None = None, colocated: bool = True) -> BuiltinEngine:
        """Engine for a run (``rollout/engines.py::build_engine``): random weights in ``model``'s dtype on
        ``gpus[0]`` (the current device without ``gpus``); the first sync fills them. Samples with one
        generator per (prompt, sample) whatever ``deterministic`` says; never sleeps unless told to, so
        ``colocated`` changes nothing here."""
        from megatron_maspo.model.hf_config import hf_config_dict

        engine = cls.from_hf_config(hf_config_dict(spec), dtype=model.torch_dtype, device=engine_device(gpus))
        engine.record_routing = model.routing_replay != "off"  # MoE routing replay
        return engine

    @classmethod
    def from_hf_config(cls, config: dict | Any, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> BuiltinEngine:
        """An engine with randomly initialised weights (like vLLM's ``load_format="dummy"``): sync before use.

        It runs on ``device``; None = the current CUDA device when CUDA is present, else the CPU.

        Args:
            config: an HF config dict (e.g. ``model.hf_config.hf_config_dict(spec)``) or ``PretrainedConfig``.
        """
        import transformers

        if isinstance(config, dict):
            config = transformers.AutoConfig.for_model(**config)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return cls(model, device=device if device is not None else default_engine_device())

    @property
    def policy_version(self) -> int:
        return self._version

    def expected_names(self) -> set[str]:
        """HF checkpoint names a sync must deliver: the model's parameters (a tied ``lm_head`` excluded)
        and its persistent buffers (the router's fp32 correction bias of GLM-4.5 / DeepSeek-V3)."""
        return set(synced_tensors(self.model))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model; the delivered name set must equal :meth:`expected_names`.

        Raises:
            ValueError: an unknown or repeated name (e.g. ``lm_head.weight`` of a tied model), a shape
                mismatch, or names missing at the end. The model is then partially updated and
                ``policy_version`` is not advanced; sync again before generating.
        """
        self._restore()
        params = synced_tensors(self.model)
        seen: set[str] = set()
        fused: dict[str, set] = {}  # transformers >= 5 fused experts: pieces delivered per parameter
        for name, t in weights:
            slot = fused_slot(name, params) if name not in params else None
            if slot is not None:
                fname, idx = slot
                dst = params[fname][idx]
                if tuple(t.shape) != tuple(dst.shape) or name in fused.setdefault(fname, set()):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)} (expected "
                                     f"{tuple(dst.shape)} in {fname!r}) or was delivered twice")
                dst.copy_(t)
                fused[fname].add(name)
                if len(fused[fname]) == pieces_per_fused(fname, params[fname]):
                    seen.add(fname)
                continue
            if name not in params:
                raise ValueError(f"load_weights: unexpected tensor {name!r} (not a parameter of "
                                 f"{type(self.model).__name__}; tied lm_head must not be sent)")
            if name in seen:
                raise ValueError(f"load_weights: tensor {name!r} delivered twice")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)}, model expects "
                                 f"{tuple(p.shape)}")
            p.copy_(t)
            seen.add(name)
        missing = params.keys() - seen
        if missing:
            raise ValueError(f"load_weights: {len(missing)} parameters not delivered: {sorted(missing)[:8]}")
        self._version += 1
        self._sleeping.discard("weights")  # the KV cache wakes separately (wake_up(["kv_cache"]) or generate)
        self._asleep = 0 if not self._sleeping else self._asleep

    def bucket_pool(self, bucket_bytes: int) -> None:
        """None: a sync packs fresh buffers (the engine copies each tensor into its parameters)."""
        return None

    def staging_pool(self) -> None:
        """None: a rollout-pool owner receives buckets into plain buffers on :attr:`device`."""
        return None

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives in this process."""

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        """Verify each bucket's checksum, then :meth:`load_weights` from zero-copy views of its buffer
        (split tensors reassembled first), then check the digests of the weights the model now holds
        against the exported ones the buckets carry (:mod:`~.digest`).

        Raises:
            digest.WeightVerifyError: a parameter holds something else than the trainer exported.
        """
        expected = digest.Expected()
        fault, self._fault = self._fault, None
        before = self._held(fault[1]).clone() if fault is not None and fault[0] == "stale" else None
        self.load_weights(unpack_stream(expected.watch(buckets), verify=verify))
        if fault is not None:
            _apply_fault(self._held(fault[1]), fault[0], before)
        if self.defer_verify:
            self._pending = (expected.digests, self._version)
        else:
            self.verify_weights(expected.digests)

    def deferred_check(self) -> Callable[[], None] | None:
        """With :attr:`defer_verify`: the digest check of the last load, to run off the engine loop (the
        caller must run it before the next load and before anything made with these weights leaves the
        engine); None when nothing is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return functools.partial(self.verify_weights, pending[0], version=pending[1])

    def inject_fault(self, kind: str, name: str | None = None) -> None:
        """Failure tests (``MASPO_FAULT=...,kind=flip_weight|stale_weight``): after the next sync's load,
        ``"flip"`` flips the lowest bit of one element of parameter ``name`` and ``"stale"`` puts its
        previous value back (a reload that skipped it); None = the first parameter."""
        if kind not in ("flip", "stale"):
            raise ValueError(f"inject_fault kind={kind!r}; accepted: 'flip', 'stale'")
        self._fault = (kind, name or next(iter(self.model.named_parameters()))[0])

    def _held(self, name: str, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor the model holds for HF name ``name`` (a slot of a fused expert parameter); ``params``:
        :func:`synced_tensors` of the model, when the caller already has it."""
        params = synced_tensors(self.model) if params is None else params
        if name in params:
            return params[name].data
        slot = fused_slot(name, params)
        if slot is None:
            raise KeyError(name)
        return params[slot[0]].data[slot[1]]

    @torch.no_grad()
    def verify_weights(self, expected: dict[str, list[int]], *, version: int | None = None) -> None:
        """Digest what the model holds for every name in ``expected`` (``{name: [stride, phase, digest]}``)
        and compare; records :attr:`verify_s` (and :attr:`verify_full_s` when every digest was full).
        ``version`` names the weight version in the error (default: the current one)."""
        self.verify_s = 0.0
        if not expected:
            return
        t0 = time.perf_counter()
        params = synced_tensors(self.model)  # parameters and the persistent buffers a sync writes
        held: dict[str, int] = {}
        names = [n for n in expected if n in params or fused_slot(n, params) is not None]
        values = digest.read(digest.digest(self._held(n, params), digest.Spec(*expected[n][:2])) for n in names)
        held.update(zip(names, values))
        self.verify_s = time.perf_counter() - t0
        if all(v[0] == 1 for v in expected.values()):
            self.verify_full_s = self.verify_s
        digest.compare(expected, held, engine=self.label, version=self._version if version is None else version)

    def sleep(self, level: int = 1) -> None:
        """Colocation hook (the KV cache lives only inside ``generate``, so it is already gone).

        Level 1 offloads the weights to host memory when the model is on a GPU (a no-op on CPU);
        level 2 frees the weights' storage on any device (shapes kept), so ``generate`` refuses to
        run until the next ``load_weights`` re-allocates and fills them. Cached GPU blocks are released.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level={level}; accepted: 1, 2")
        with torch.no_grad():
            if level == 2:
                for name, p in self.model.named_parameters():
                    self._dropped.setdefault(name, p.shape)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            elif self.device.type != "cpu":
                self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = level
        self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep`, all of it or only ``"weights"`` / ``"kv_cache"`` (vLLM's tags; the KV cache
        lives only inside ``generate`` here, so waking it costs nothing)."""
        want = {"weights", "kv_cache"} if tags is None else set(tags)
        if "weights" in want & self._sleeping:
            if self._asleep == 2:
                raise RuntimeError("engine slept at level 2 (weights dropped): call load_weights, not wake_up")
            self._restore()
        self._sleeping -= want
        if not self._sleeping:
            self._asleep = 0

    def _restore(self) -> None:
        """Back on ``self.device``, with parameter storage re-allocated after a level-2 sleep."""
        with torch.no_grad():
            self.model.to(self.device)
            for name, p in self.model.named_parameters():
                if name in self._dropped:
                    p.data = torch.empty(self._dropped.pop(name), dtype=p.dtype, device=self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None,
                 on_step: Callable[[], object] | None = None) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt; see :class:`~.types.Engine`.

        Args:
            progress: called with the number of sequences that finished since the last call
                (``P·n`` in all by the time it returns).
            on_step: in-flight weight updates: called after every decode step; it may call
                :meth:`load_weights` (the next token is sampled by the new weights over the KV cache the
                old ones built). Each completion then records ``token_versions``.

        Returns:
            ``[P][n]`` completions with per-token log-probs of ``log_softmax(z / T)`` (full vocabulary).
        """
        if "weights" in self._sleeping:
            raise RuntimeError(f"engine is asleep (level {self._asleep}); wake_up / load_weights first")
        self.wake_up(["kv_cache"])  # nothing to allocate: the cache is built per call
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompts must be a non-empty list of non-empty token-id lists")
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        gens = [self._row_generator(params.seed, params.first_prompt + i, j) for i, j in rows]
        dev = self.device
        ids, mask = (t.to(dev) for t in _left_pad([prompts[i] for i, _ in rows]))
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev)
        greedy = params.temperature == 0
        out_tok = torch.zeros(len(rows), params.max_tokens, dtype=torch.long, device=dev)
        out_lp = torch.zeros(len(rows), params.max_tokens, device=dev)
        length = torch.full((len(rows),), params.max_tokens, device=dev)
        done = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        cache, step_ids, step_pos = None, ids, pos
        rec = self._routing_recorder()
        versions: list[int] = []  # the weight version of each decode step (in-flight updates)
        for t in range(params.max_tokens):
            versions.append(self._version)
            if cache is None:  # the supported cache API: an explicit Cache object, filled in place
                cache = _new_cache(self.model.config)
            # logits_to_keep=1: the prefill projects only the last prompt position onto the vocabulary
            if rec is not None:
                rec.begin_call(*step_ids.shape)
            out, cache = forward_with_cache(self.model, cache, input_ids=step_ids, attention_mask=mask,
                                            position_ids=step_pos, use_cache=True, logits_to_keep=1)
            if rec is not None:
                rec.end_call()
            lp = scaled_logprobs(out.logits[:, -1], params.temperature)
            tok = sample_tokens(lp, params.top_p, greedy, gens)
            out_tok[:, t] = tok
            out_lp[:, t] = lp.gather(-1, tok[:, None]).squeeze(-1)
            hit = torch.isin(tok, stop) & ~done
            length[hit] = t + 1
            done |= hit
            if progress is not None and bool(hit.any()):
                progress(int(hit.sum()))
            if bool(done.all()):
                break
            step_ids, step_pos = tok[:, None], step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if on_step is not None:
                on_step()
        if progress is not None and not bool(done.all()):
            progress(int((~done).sum()))  # rows cut at max_tokens finish here
        result: list[list[Completion]] = [[] for _ in prompts]
        out_tok, out_lp, length, done = out_tok.cpu(), out_lp.cpu(), length.cpu(), done.cpu()
        routed = (rec.per_row([len(prompts[i]) for i, _ in rows], [int(n) for n in length])
                  if rec is not None else [None] * len(rows))
        for r, (i, _) in enumerate(rows):
            n_tok = int(length[r])
            result[i].append(Completion(token_ids=out_tok[r, :n_tok].tolist(), logprobs=out_lp[r, :n_tok].tolist(),
                                        finish_reason="stop" if bool(done[r]) else "length",
                                        policy_version=versions[0],
                                        token_versions=versions[:n_tok] if on_step is not None else None,
                                        routed_experts=routed[r]))
        return result

    def _routing_recorder(self) -> RoutingRecorder | None:
        """The gate-hook recorder, emptied, when ``record_routing`` is on (None otherwise)."""
        if not self.record_routing:
            if self._recorder is not None:
                self._recorder.__exit__()
                self._recorder = None
            return None
        if self._recorder is None:
            self._recorder = RoutingRecorder(self.model).__enter__()
        self._recorder.reset()
        return self._recorder

    @staticmethod
    def _row_generator(seed: int | None, prompt: int, sample: int) -> torch.Generator:
        g = torch.Generator()
        if seed is None:
            g.seed()
        else:
            g.manual_seed((seed * _SEED_STRIDE + prompt) * _SEED_STRIDE + sample)
        return g


def _apply_fault(t: torch.Tensor, kind: str, before: torch.Tensor | None) -> None:
    """The injected fault on parameter data ``t``: flip the lowest bit of element 0, or restore ``before``."""
    if kind == "stale":
        t.copy_(before)
        return
    flat = t.view(-1)
    word = flat[:1].view(torch.uint8)
    word[0] ^= 1  # lowest byte (little-endian) of the first element: its least significant mantissa bit


def engine_device(gpus: tuple[int, ...] | None = None, *, cuda: bool | None = None) -> torch.device:
    """The device of a built-in engine placed on ``gpus`` (``FleetLayout.engine_gpus``, whose first entry is
    the owner rank's GPU): ``cuda:gpus[0]``, or the current CUDA device when ``gpus`` is None; the CPU
    without CUDA. ``cuda`` overrides the CUDA check (tests)."""
    if not (on_cuda() if cuda is None else cuda):
        return torch.device("cpu")
    return torch.device("cuda", gpus[0] if gpus else torch.cuda.current_device())


def default_engine_device() -> torch.device:
    """The current CUDA device when CUDA is present (``set_device(LOCAL_RANK)`` picks it), else the CPU."""
    if on_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_cache(config: Any) -> Any:
    """An empty ``transformers.DynamicCache`` laid out for ``config`` (per-layer types, e.g. sliding)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56: no per-layer layout, one dynamic layer type
        return DynamicCache()


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to [B, L] ids (pad 0) and a [B, L] int64 attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s):] = 1
    return ids, mask
