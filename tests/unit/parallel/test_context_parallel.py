"""The CP split's index maths: Megatron's load-balanced chunk order, its inverse and token owners."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.parallel.context_parallel import (
    check_cp_bounds,
    cp_gather_order,
    cp_local_positions,
    cp_owner,
    cp_padded_length,
    local_bounds,
)


def test_padded_length_is_megatrons_multiple_of_two_cp():
    assert [cp_padded_length(n, 2) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert cp_padded_length(13, 3) == 18
    with pytest.raises(ValueError):
        cp_padded_length(3, 0)


def test_rank_holds_head_and_tail_chunk():
    # one sequence of 8 at cp=2: chunks of 2; rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_local_positions([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_local_positions([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    # two sequences: the split is per sequence, concatenated
    assert cp_local_positions([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_gather_order_inverts_the_split():
    bounds = [0, 12, 16, 40]  # each a multiple of 4
    for cp in (1, 2):
        row = torch.arange(40) * 10
        parts = [row[cp_local_positions(bounds, cp, r)] for r in range(cp)]
        assert torch.equal(torch.cat(parts)[cp_gather_order(bounds, cp)], row)
    bounds6 = [0, 6, 18]
    row = torch.arange(18)
    parts = [row[cp_local_positions(bounds6, 3, r)] for r in range(3)]
    assert torch.equal(torch.cat(parts)[cp_gather_order(bounds6, 3)], row)


def test_owner_matches_local_positions():
    bounds, cp = [0, 8, 12, 36], 2
    pos = torch.arange(36)
    rank, local = cp_owner(pos, bounds, cp)
    for r in range(cp):
        held = cp_local_positions(bounds, cp, r)
        assert torch.equal(held[local[rank == r]], pos[rank == r])
        assert int((rank == r).sum()) == held.numel() == 18


def test_bounds_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        check_cp_bounds([0, 6], 2)
    assert local_bounds([0, 4, 12], 2) == [0, 2, 6]
