"""Pack (prompt, response) sequences into padding-free micro-batches under a token budget.

Pure and deterministic (no torch.distributed): every rank holds the same global list of samples,
computes the same plan, and builds tensors only for its own data-parallel shard. That makes the
old-log-prob recompute and the training forward see **identical** micro-batches (so ``ρ = 1``
exactly on the first mini-batch, loss-formulas.md §0.3) and makes the global token count ``N_glob`` a
local computation.

Layout of one micro-batch: the sequences ``prompt_i ++ response_i`` are concatenated in one row of
``S = Σ_i (P_i + L_i)`` tokens, positions restart at 0 for every sequence, and attention is
block-diagonal causal: :func:`cu_seqlens` gives the sequence bounds the packed attention paths
read (linear memory); :func:`block_causal_mask` builds the dense ``[S, S]`` reference mask. The log-prob of response token ``j`` of sequence
``i`` is read from the hidden state one position earlier (``resp_index``), so prompt positions are
never projected onto the vocabulary.

Steps: :func:`trim_lengths` (truncate over-long responses, drop empty ones, count both) →
:func:`split_mini_batches` (by prompt) → :func:`shard_for_dp` (balance tokens) →
:func:`assign_micro_batches` (same micro-batch count on every DP rank) → :func:`build_micro_batch`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_maspo.train.actor.samples import Sample

logger = logging.getLogger(__name__)


@dataclass
class PackStats:
    """What packing had to change; reported as ``actor/*`` metrics."""

    truncated: int = 0
    """Responses cut so that prompt + response fits the micro-batch budget."""
    truncated_tokens: int = 0
    """Response tokens dropped by truncation."""
    empty: int = 0
    """Responses with no token to train on (empty, or a prompt that fills the budget); skipped."""


@dataclass
class PackedMicroBatch:
    """One padding-free micro-batch row (single DP rank).

    Attributes:
        tokens: [S] int64 concatenated prompt+response ids.
        position_ids: [S] int64, restarting at 0 for each sequence.
        seq_lens: length of each packed sequence (their sum is S).
        sample_index: global sample index of each packed sequence.
        resp_index: [T] int64 row positions whose hidden state predicts a response token.
        labels: [T] int64 the response token predicted there.
        seq_ids: [T] int64 global sample index of each response token.
        loss_mask: [T] fp32, 1 for trained tokens (0 only in a filler micro-batch).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: list[int]
    sample_index: list[int]
    resp_index: torch.Tensor
    labels: torch.Tensor
    seq_ids: torch.Tensor
    loss_mask: torch.Tensor
    resp_lens: list[int] = field(default_factory=list)
    """Trained response tokens of each packed sequence (same order as ``sample_index``)."""

    @property
    def num_tokens(self) -> int:
        """Valid (trained) response tokens in this micro-batch."""
        return int(sum(self.resp_lens))


def trim_lengths(samples: Sequence[Sample], max_seq_len: int) -> tuple[list[int], PackStats]:
    """Trained response length of every sample (0 = skipped), after fitting ``max_seq_len``.

    A response is cut (from the end) so that ``P + L' <= max_seq_len``; the dropped tail takes no
    part in the loss. The prompt is never cut here (the data pipeline truncates prompts).
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    stats = PackStats()
    out = []
    for s in samples:
        room = max(0, max_seq_len - len(s.prompt_ids))
        n = min(len(s.response_ids), room)
        if n < len(s.response_ids):
            stats.truncated += 1
            stats.truncated_tokens += len(s.response_ids) - n
        if n == 0:
            stats.empty += 1
        out.append(n)
    if stats.truncated or stats.empty:
        logger.info("packing: %d responses truncated (%d tokens), %d empty/skipped",
                    stats.truncated, stats.truncated_tokens, stats.empty)
    return out, stats


def split_mini_batches(samples: Sequence[Sample], n: int) -> list[list[int]]:
    """Split sample indices into ``n`` mini-batches of (nearly) equal numbers of prompts.

    Prompts keep their order of first appearance; all responses of a prompt land in the same
    mini-batch (group-level statistics such as QUATRO's per-prompt duals stay within one step).
    """
    if n < 1:
        raise ValueError(f"number of mini-batches must be >= 1, got {n}")
    order: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        order.setdefault(s.prompt_index, []).append(i)
    groups = list(order.values())
    if len(groups) < n:
        raise ValueError(f"{len(groups)} prompts cannot fill train.mini_batches_per_step={n}")
    bounds = [round(k * len(groups) / n) for k in range(n + 1)]
    return [[i for g in groups[bounds[k]:bounds[k + 1]] for i in g] for k in range(n)]


def shard_for_dp(indices: Sequence[int], lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Assign sequences to ``dp`` ranks, longest first to the least-loaded rank (LPT).

    Args:
        indices: global sample indices of the mini-batch (only ones with a trained response).
        lengths: packed length ``P + L'`` of each index (same order).
        dp: data-parallel size.

    Returns:
        ``dp`` lists of indices, each in ascending order.
    """
    load = [0] * dp
    shards: list[list[int]] = [[] for _ in range(dp)]
    for i, n in sorted(zip(indices, lengths), key=lambda x: (-x[1], x[0])):
        r = min(range(dp), key=lambda k: (load[k], k))
        shards[r].append(i)
        load[r] += n
    return [sorted(s) for s in shards]


def _lpt_bins(items: list[tuple[int, int]], m: int, budget: int) -> list[list[int]] | None:
    """Longest-first into the least-loaded of ``m`` bins with room; None if one does not fit."""
    load = [0] * m
    bins: list[list[int]] = [[] for _ in range(m)]
    for i, n in sorted(items, key=lambda x: (-x[1], x[0])):
        fits = [k for k in range(m) if load[k] + n <= budget]
        if not fits:
            return None
        k = min(fits, key=lambda k: (load[k], k))
        bins[k].append(i)
        load[k] += n
    return [sorted(b) for b in bins]


def assign_micro_batches(shards: list[list[tuple[int, int]]], budget: int) -> list[list[list[int]]]:
    """Pack every DP shard into the same number ``M`` of micro-batches of at most ``budget`` tokens.

    Pipeline schedules need no equal count, but DP-collective losses (BAPO, QUATRO) and an even
    pipeline do; ``M`` starts at ``max ⌈tokens/budget⌉`` and grows until longest-first packing fits
    every shard. Balanced loads also keep pipeline bubbles small. A shard with fewer sequences
    than ``M`` gets empty bins (the actor fills them with a masked one-token row).

    Args:
        shards: per DP rank, ``(sample_index, packed_length)`` pairs; each length <= ``budget``.
        budget: max tokens per micro-batch row.

    Returns:
        ``[dp][M]`` lists of sample indices.
    """
    for shard in shards:
        for i, n in shard:
            if n > budget:
                raise ValueError(f"sample {i}: packed length {n} > max_tokens_per_micro_batch {budget}")
    m = max([1] + [math.ceil(sum(n for _, n in s) / budget) for s in shards])
    while True:
        out = [_lpt_bins(s, m, budget) for s in shards]
        if all(b is not None for b in out):
            return out  # type: ignore[return-value]
        m += 1


def build_micro_batch(samples: Sequence[Sample], index: Sequence[int],
                      resp_lens: Sequence[int], *, pad_to: int = 0,
                      seq_multiple: int = 1) -> PackedMicroBatch:
    """Concatenate ``samples[i]`` for ``i in index`` into one row (trained responses only).

    An empty ``index`` gives a filler row: one token, one masked response position, so every DP
    rank runs the same number of micro-batches.

    Args:
        pad_to: if larger than the packed length, append a padding segment (token 0, positions
            from 0, its own attention block, no response position) up to this length. Padding
            tokens attend only to each other and never reach the loss, so they change nothing but
            the row length (MoE routing is dropless here: they take no capacity from real tokens).
        seq_multiple: pad every sequence at its end (token 0, positions continuing) to a multiple
            of this; context parallelism splits each sequence into ``2·cp`` equal chunks. The
            padding comes after the sequence's last token, so causal attention hides it.
    """
    if not index:
        z = torch.zeros(1, dtype=torch.long)
        mb = PackedMicroBatch(tokens=z, position_ids=z.clone(), seq_lens=[1], sample_index=[],
                              resp_index=z.clone(), labels=z.clone(), seq_ids=z.clone(),
                              loss_mask=torch.zeros(1), resp_lens=[])
        if seq_multiple > 1:
            mb.tokens = mb.position_ids = torch.zeros(seq_multiple, dtype=torch.long)
            mb.seq_lens = [seq_multiple]
        return _pad_row(mb, pad_to)
    sel = list(index)
    rl = [int(resp_lens[i]) for i in sel]
    p_lens = torch.tensor([len(samples[i].prompt_ids) for i in sel], dtype=torch.long)
    n_lens = torch.tensor(rl, dtype=torch.long)
    seq = p_lens + n_lens
    # One conversion per sample (the rollout hands lists); everything per token is a tensor op.
    resp = [torch.as_tensor(samples[i].response_ids[:n], dtype=torch.long) for i, n in zip(sel, rl)]
    parts = []
    pads = (-seq) % max(seq_multiple, 1)  # per-sequence tail padding (context parallelism)
    for i, r, k in zip(sel, resp, pads.tolist()):
        parts += [torch.as_tensor(samples[i].prompt_ids, dtype=torch.long), r,
                  torch.zeros(k, dtype=torch.long)]
    tokens = torch.cat(parts)
    seq = seq + pads
    starts = torch.cumsum(seq, 0) - seq
    positions = torch.arange(tokens.numel()) - torch.repeat_interleave(starts, seq)
    # hidden at position t predicts token t + 1: response token j of sequence k sits at
    # starts_k + P_k + j, so its predictor is starts_k + P_k - 1 + j
    t = int(n_lens.sum())
    r_starts = torch.cumsum(n_lens, 0) - n_lens
    ridx = torch.arange(t) + torch.repeat_interleave(starts + p_lens - 1 - r_starts, n_lens)
    mb = PackedMicroBatch(
        tokens=tokens, position_ids=positions, seq_lens=seq.tolist(), sample_index=sel,
        resp_index=ridx, labels=torch.cat(resp),
        seq_ids=torch.repeat_interleave(torch.tensor(sel, dtype=torch.long), n_lens),
        loss_mask=torch.ones(t), resp_lens=rl)
    return _pad_row(mb, pad_to)


def token_inputs(samples: Sequence[Sample], mb: PackedMicroBatch) -> dict[str, torch.Tensor | None]:
    """Per-response-token loss inputs of a micro-batch, built per sample (no per-token Python).

    Returns:
        ``advantages`` [T] fp32 (the sequence advantage broadcast), ``prompt_ids`` [T] int64, and
        ``old_logprobs`` / ``ref_logprobs`` / ``rollout_logprobs`` [T] fp32, each None when any
        packed sample lacks it. A filler row (no sample) gives one zero of each (its token is masked).
    """
    if not mb.sample_index:
        zero = torch.zeros(1)
        return {"advantages": zero, "prompt_ids": torch.zeros(1, dtype=torch.long),
                "old_logprobs": zero, "ref_logprobs": zero, "rollout_logprobs": zero}
    sel = [samples[i] for i in mb.sample_index]
    n = torch.tensor(mb.resp_lens, dtype=torch.long)
    out: dict[str, torch.Tensor | None] = {
        "advantages": torch.repeat_interleave(
            torch.tensor([float(s.advantage) for s in sel], dtype=torch.float32), n),
        "prompt_ids": torch.repeat_interleave(
            torch.tensor([s.prompt_index for s in sel], dtype=torch.long), n)}
    for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        vals = [getattr(s, name) for s in sel]
        out[name] = None if any(v is None for v in vals) else torch.cat(
            [torch.as_tensor(v, dtype=torch.float32).reshape(-1)[:k]
             for v, k in zip(vals, mb.resp_lens)])
    return out


def _pad_row(mb: PackedMicroBatch, pad_to: int) -> PackedMicroBatch:
    """Append a masked padding segment so the row has ``pad_to`` tokens (no-op if already longer)."""
    extra = pad_to - int(mb.tokens.numel())
    if extra <= 0:
        return mb
    mb.tokens = torch.cat([mb.tokens, torch.zeros(extra, dtype=torch.long)])
    mb.position_ids = torch.cat([mb.position_ids, torch.arange(extra, dtype=torch.long)])
    mb.seq_lens = [*mb.seq_lens, extra]
    return mb


def cu_seqlens(seq_lens: Sequence[int]) -> list[int]:
    """Sequence bounds of a packed row: ``[0, n_0, n_0 + n_1, ..., S]`` (``n + 1`` entries)."""
    out = [0]
    for n in seq_lens:
        if n <= 0:
            raise ValueError(f"packed sequence lengths must be > 0, got {list(seq_lens)}")
        out.append(out[-1] + int(n))
    return out


def block_causal_mask(seq_lens: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Megatron attention mask for a packed row: ``[1, 1, S, S]`` bool, True = **masked out**.

    Token ``q`` attends to ``k`` iff both lie in the same sequence and ``k <= q``. O(S²) memory:
    only ``model.attention_backend="dense_mask"`` (the reference path) uses it; the packed paths
    take ``cu_seqlens`` instead and never materialise it.
    """
    ids = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                  torch.tensor(list(seq_lens), device=device))
    s = ids.numel()
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    allowed = causal & (ids[:, None] == ids[None, :])
    return (~allowed).view(1, 1, s, s)


@dataclass
class MiniBatchPlan:
    """One optimizer step's data for this rank.

    Attributes:
        micro_batches: this DP rank's micro-batches (same count on every DP rank).
        num_tokens_global: N_glob, trained response tokens over all DP ranks.
        num_seqs_global: S_glob, trained responses over all DP ranks.
    """

    micro_batches: list[PackedMicroBatch]
    num_tokens_global: int
    num_seqs_global: int


def plan_mini_batch(samples: Sequence[Sample], index: Sequence[int], resp_lens: Sequence[int], *,
                    dp: int, dp_rank: int, budget: int, equal_rows: bool = False,
                    row_multiple: int = 1, seq_multiple: int = 1) -> MiniBatchPlan:
    """Pack the mini-batch ``index`` for data-parallel rank ``dp_rank`` of ``dp``.

    Args:
        equal_rows: pad micro-batch ``k`` of every DP rank to the longest micro-batch ``k`` over all
            DP ranks (computed locally: every rank knows every shard). Megatron's allgather MoE
            token dispatcher (the CPU path at EP > 1) all-gathers equal-sized token blocks over the
            EP group, which spans DP ranks.
        row_multiple: pad every row up to a multiple of this (sequence parallelism splits the
            row over TP ranks, so its length must divide by TP).
        seq_multiple: pad every sequence to a multiple of this (``2·cp``); budgets and rows count
            the padded lengths (a multiple of ``row_multiple`` keeps filler segments aligned).
    """
    kept = [i for i in index if resp_lens[i] > 0]
    m = max(seq_multiple, 1)
    lens = [-(-(len(samples[i].prompt_ids) + resp_lens[i]) // m) * m for i in kept]
    shards = shard_for_dp(kept, lens, dp)
    length = dict(zip(kept, lens))
    bins = assign_micro_batches([[(i, length[i]) for i in s] for s in shards], budget)
    rows = [[max(m, sum(length[i] for i in b)) for b in r] for r in bins]  # [dp][M]
    pad = [max(col) if equal_rows else 0 for col in zip(*rows)]
    if row_multiple > 1:
        pad = [-(-max(p, n) // row_multiple) * row_multiple for p, n in zip(pad, rows[dp_rank])]
    mbs = [build_micro_batch(samples, b, resp_lens, pad_to=n, seq_multiple=m)
           for b, n in zip(bins[dp_rank], pad)]
    return MiniBatchPlan(micro_batches=mbs, num_tokens_global=sum(resp_lens[i] for i in kept),
                         num_seqs_global=len(kept))
