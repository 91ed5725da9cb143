"""The one rule for which metrics are wall-clock (run comparisons drop exactly these)."""

from megatron_maspo.train.observe.timing_keys import is_timing


def test_timings_rates_and_sync_durations_are_timing():
    for key in ("time/step", "memory/peak_gb", "rollout/gen_tokens_per_s", "rollout/gen_tokens_per_s_engine1",
                "sync/gb_per_s", "sync/sender_gb_per_s", "sync/transfer_s", "sync/engine_pause_s", "sync/verify_s",
                "sync/verify_full_s", "rollout/engine_busy_s"):
        assert is_timing(key), key


def test_results_and_byte_counts_are_not():
    for key in ("actor/loss", "actor/grad_norm", "reward/mean", "sync/bytes_total", "sync/sender_bytes_max",
                "sync/host_copy_bytes", "rollout/policy_version", "rollout/staleness_max", "data/skipped_rows"):
        assert not is_timing(key), key
