"""``sync_metrics``: the per-sync figures from every trainer rank's (bytes sent, seconds)."""

from __future__ import annotations

import pytest

from megatron_maspo.rollout.weight_sync import sync_metrics


def test_sharded_sums_the_senders_and_takes_the_slowest():
    got = sync_metrics([(6e6, 0.5), (4e6, 0.8), (0.0, 0.9)], sharded=True)  # rank 2 only joined a gather
    assert got["sync/bytes_total"] == 10e6 and got["sync/sender_bytes_max"] == 6e6
    assert got["sync/transfer_s"] == 0.8  # a rank that sent nothing does not stretch the transfer
    assert got["sync/gb_per_s"] == pytest.approx(10e6 / 0.8 / 1e9)
    assert got["sync/sender_gb_per_s"] == pytest.approx(6e6 / 0.8 / 1e9)


def test_funnel_and_colocated_count_one_copy():
    # the funnel: rank 0 sends everything; colocated: every owner packs its own full copy
    assert sync_metrics([(10e6, 0.4), (0.0, 0.3)], sharded=False)["sync/bytes_total"] == 10e6
    got = sync_metrics([(10e6, 0.4), (10e6, 0.5)], sharded=False)
    assert got["sync/bytes_total"] == got["sync/sender_bytes_max"] == 10e6 and got["sync/transfer_s"] == 0.5
