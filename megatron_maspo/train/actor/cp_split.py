"""A packed micro-batch split over the context-parallel ranks, and CP-split values put back together.

Packing pads every sequence to a multiple of ``2·cp`` (``plan_mini_batch(seq_multiple=2·cp)``); this
module gives CP rank ``r`` its rows in Megatron's load-balanced order
(:mod:`megatron_maspo.parallel.context_parallel`) and the response tokens whose *predictor* row it
holds: the hidden state at row ``t`` predicts token ``t + 1``, so the log-prob of a response token
is computed on the rank that holds its predictor, whichever rank holds the token itself. Each rank
computes only its own tokens' log-probs and loss terms; token sums reduce over DP x CP.

Every rank computes every rank's split from the same host ints, so :func:`unsplit_tokens` needs one
all-gather and no exchange of indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.context_parallel import cp_local_positions, cp_owner
from megatron_maspo.train.actor.packing import PackedMicroBatch, cu_seqlens


@dataclass
class CPShare:
    """What CP rank ``cp_rank`` holds of one padded micro-batch row of ``S`` tokens.

    Attributes:
        rows: ``[S/cp]`` int64 global row positions of the local rows (local order).
        keep: ``[T_r]`` int64 indices into the micro-batch's ``[T]`` response tokens this rank computes.
        resp_index: ``[T_r]`` int64 local rows of those tokens' predictors.
        counts: ``T_r`` of every CP rank (same on all ranks), for :func:`unsplit_tokens`.
        keeps: ``keep`` of every CP rank.
        cp_rank: the rank this share is for.

    A rank that predicts no response token of the row (a short filler row) computes one masked
    dummy token at local row 0 instead: every kernel and loss keeps a non-empty input.
    """

    rows: torch.Tensor
    keep: torch.Tensor
    resp_index: torch.Tensor
    counts: list[int]
    keeps: list[torch.Tensor]
    cp_rank: int = 0

    @property
    def dummy(self) -> bool:
        """True when this rank computes a masked stand-in token (it predicts none of the row)."""
        return self.counts[self.cp_rank] == 0


def cp_share(mb: PackedMicroBatch, cp: int, cp_rank: int) -> CPShare:
    """CP rank ``cp_rank``'s share of ``mb`` (whose sequences are padded to multiples of ``2·cp``)."""
    bounds = cu_seqlens(mb.seq_lens)
    owner, local = cp_owner(mb.resp_index, bounds, cp)
    keeps = [torch.nonzero(owner == r).flatten() for r in range(cp)]
    keep = keeps[cp_rank]
    return CPShare(rows=cp_local_positions(bounds, cp, cp_rank), keep=keep,
                   resp_index=local.index_select(0, keep), counts=[int(k.numel()) for k in keeps],
                   keeps=keeps, cp_rank=cp_rank)


def local_micro_batch(mb: PackedMicroBatch, share: CPShare) -> PackedMicroBatch:
    """The micro-batch as this CP rank sees it: local rows and its own response tokens.

    ``seq_lens``, ``sample_index`` and ``resp_lens`` stay the global row's (attention reads the
    global padded bounds; samples are split back by ``resp_lens`` after :func:`unsplit_tokens`).
    """
    k = share.keep
    rows = mb.tokens.index_select(0, share.rows), mb.position_ids.index_select(0, share.rows)
    if share.dummy:
        z = torch.zeros(1, dtype=torch.long)
        return PackedMicroBatch(tokens=rows[0], position_ids=rows[1], seq_lens=list(mb.seq_lens),
                                sample_index=list(mb.sample_index), resp_index=z, labels=z.clone(),
                                seq_ids=mb.seq_ids[:1].clone(), loss_mask=torch.zeros(1),
                                resp_lens=list(mb.resp_lens))
    return PackedMicroBatch(
        tokens=rows[0], position_ids=rows[1], seq_lens=list(mb.seq_lens),
        sample_index=list(mb.sample_index), resp_index=share.resp_index,
        labels=mb.labels.index_select(0, k), seq_ids=mb.seq_ids.index_select(0, k),
        loss_mask=mb.loss_mask.index_select(0, k), resp_lens=list(mb.resp_lens))


def select_tokens(values: dict[str, torch.Tensor | None], share: CPShare) -> dict[str, torch.Tensor | None]:
    """Per-response-token tensors ``[T]`` → this rank's ``[T_r]`` (None stays None; the dummy
    token takes token 0's values, and its mask is 0)."""
    idx = share.keep if not share.dummy else torch.zeros(1, dtype=torch.long)
    return {name: (None if v is None else v.index_select(0, idx.to(v.device)))
            for name, v in values.items()}


def unsplit_tokens(local: torch.Tensor, share: CPShare, cp_group: Any) -> torch.Tensor:
    """``[T_r]`` per CP rank → the micro-batch's ``[T]`` in token order, on every CP rank.

    Ranks hold different counts: each pads to the largest before the all-gather.
    """
    width = max(share.counts)
    mine = share.counts[share.cp_rank]
    buf = torch.zeros(width, dtype=local.dtype, device=local.device)
    buf[:mine] = local[:mine]  # the dummy token (mine = 0) is dropped
    parts = comm.all_gather(buf, group=cp_group)
    out = torch.empty(sum(share.counts), dtype=local.dtype, device=local.device)
    for part, n, idx in zip(parts, share.counts, share.keeps):
        out[idx.to(local.device)] = part[:n]
    return out
