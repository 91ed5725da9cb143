"""Config checks that run once, on the final config, before any model is built (one line each)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_maspo.cli.common import launcher_overrides
from megatron_maspo.errors import ConfigError
from megatron_maspo.recipes.registry import resolve_config


@pytest.mark.parametrize("order", [
    ["parallel.tp=2", "parallel.world_size=2"],
    ["parallel.world_size=2", "parallel.tp=2"],
])
def test_overrides_are_validated_once_in_any_order(order):
    cfg = resolve_config("tiny", None, order)
    assert (cfg.parallel.tp, cfg.parallel.world_size) == (2, 2)


def test_a_final_config_that_is_invalid_names_the_assignments():
    with pytest.raises(ConfigError, match=r"parallel.tp=2 rejected: parallel.world_size=1 is not divisible"):
        resolve_config("tiny", None, ["parallel.tp=2"])


def test_world_size_comes_from_the_launcher_unless_set():
    assert launcher_overrides(["parallel.tp=2"], {"WORLD_SIZE": "2"}) == ["parallel.world_size=2", "parallel.tp=2"]
    assert launcher_overrides(["parallel.world_size=4"], {"WORLD_SIZE": "2"}) == ["parallel.world_size=4"]
    assert launcher_overrides(["a.b=1"], {}) == ["a.b=1"]
    cfg = resolve_config("tiny", None, launcher_overrides(["parallel.tp=2"], {"WORLD_SIZE": "2"}))
    assert cfg.parallel.world_size == 2


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match=f"optim.lr: '{value}' is not a finite number"):
        resolve_config("tiny", None, [f"optim.lr={value}"])


@pytest.mark.parametrize("budget", ["1", "100"])
def test_a_token_budget_below_the_longest_sequence_is_one_line(budget):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", None, [f"train.max_tokens_per_micro_batch={budget}"])
    msg = str(e.value)
    assert "\n" not in msg and f"train.max_tokens_per_micro_batch={budget} is below the longest possible " \
        "sequence, data.max_prompt_tokens + rollout.max_new_tokens = 140" in msg, msg


def test_a_dataset_with_no_usable_row_is_one_line_before_any_model(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps({"question": "q"}), "{not json", json.dumps({"answer": "1"})]) + "\n")
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--set", f"data.source={bad}",
                        "--set", f"checkpoint.run_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"maspo train: error: data.source='{bad}': no usable row (skipped: ") and \
        "no_answer" in last and "bad_json" in last and "empty_prompt" in last, last
    assert "megatron_maspo.train" not in r.stderr  # nothing was built
