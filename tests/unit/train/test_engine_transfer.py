"""``sync/transfer_s`` of a disaggregated job ends on the slowest engine's last staged byte
(``remote.engine_transfer``), once every owner has reported the sync; the senders' own figure is
``sync/send_s`` (``sync_metrics(at_engines=True)``)."""

from __future__ import annotations

import pytest

from megatron_maspo.rollout.weight_sync import sync_metrics
from megatron_maspo.train.observe.timing_keys import is_timing
from megatron_maspo.train.rollouts.remote import engine_transfer


def _entry(n: int, staged: float, pause: float) -> dict:
    return {"sync": n, "staged_at": staged, "engine_pause_s": pause, "verify_s": 0.0, "verify_full_s": None}


def test_a_sync_is_reported_once_every_owner_staged_it_from_the_slowest():
    starts, landed = {1: 100.0, 2: 110.0}, {}
    # owner A reports sync 1 with one batch, owner B with the next: nothing until both are in
    assert engine_transfer(starts, landed, [_entry(1, 100.5, 0.05)], owners=2) == {}
    got = engine_transfer(starts, landed, [_entry(1, 100.8, 0.1), _entry(2, 110.4, 0.02)], owners=2)
    assert got["sync/transfer_s"] == pytest.approx(0.8)  # B, the slower one, staged last
    assert got["sync/engine_pause_share"] == pytest.approx(0.1 / 0.8)
    assert 1 not in starts and 1 not in landed and landed[2]  # sync 2 waits for its second owner
    got = engine_transfer(starts, landed, [_entry(2, 110.6, 0.03)], owners=2)
    assert got["sync/transfer_s"] == pytest.approx(0.6) and not starts and not landed
    assert all(is_timing(k) for k in got)


def test_entries_without_a_start_are_held_and_old_ones_dropped_with_a_later_sync():
    starts, landed = {3: 10.0}, {}
    # a rank that started no sync (not the lead sender) reports nothing
    assert engine_transfer({}, {}, [_entry(1, 1.0, 0.1)], owners=1) == {}
    got = engine_transfer(starts, landed, [_entry(2, 5.0, 0.1), _entry(3, 10.5, 0.1)], owners=1)
    assert got["sync/transfer_s"] == pytest.approx(0.5) and not landed  # sync 2 (no start) dropped with 3


def test_the_senders_figure_is_send_s_when_the_engines_end_the_transfer():
    got = sync_metrics([(6e6, 0.5), (4e6, 0.8)], sharded=True, at_engines=True)
    assert got["sync/send_s"] == 0.8 and "sync/transfer_s" not in got
    assert got["sync/gb_per_s"] == pytest.approx(10e6 / 0.8 / 1e9)
    assert "sync/transfer_s" in sync_metrics([(6e6, 0.5)], sharded=True)
