"""``maspo``: only working subcommands exist, --print-config, and config errors are one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_maspo.cli.main import SUBCOMMANDS, build_parser, main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", *args], capture_output=True,
                          text=True, timeout=120)


def test_help_lists_only_registered_subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    registered = set(sub.choices)
    assert registered <= set(SUBCOMMANDS) and "train" in registered
    for name in registered:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0


def test_print_config_and_bad_set():
    ok = _run("train", "--print-config", "--set", "loss.maspo.alpha=0.5")
    assert ok.returncode == 0, ok.stderr
    assert "alpha: 0.5" in ok.stdout
    bad = _run("train", "--print-config", "--set", "loss.maspo.alpah=0.5")
    assert bad.returncode == 2 and "loss.maspo.alpah" in bad.stderr and "accepts" in bad.stderr
    ch = _run("train", "--print-config", "--set", "loss.method=clip_higher")
    assert ch.returncode == 0 and "eps_high: 0.265" in ch.stdout
    bad = _run("train", "--print-config", "--set", "rollout.engine=sglang")
    assert bad.returncode == 2 and "accepted: ['builtin', 'vllm']" in bad.stderr
    bad = _run("train", "--recipe", "nope")
    assert bad.returncode == 2 and "unknown recipe" in bad.stderr
