"""``maspo``: only working subcommands exist, --print-config, and config errors are one clear line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import yaml

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


def _py(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_resume_of_a_missing_directory_says_so(tmp_path):
    bad = _run("train", "--resume", str(tmp_path / "nope"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"maspo train: error: --resume {tmp_path / 'nope'}: no such run directory"]
    (tmp_path / "empty").mkdir()
    bad = _run("train", "--resume", str(tmp_path / "empty"))
    assert bad.returncode == 2 and "no config.yaml in it" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_run_dir_with_checkpoints_is_refused_before_megatron_is_imported(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_3").mkdir(parents=True)
    res = _py("import sys\nfrom megatron_maspo.cli.main import main\n"
              f"rc = main(['train', '--set', 'checkpoint.run_dir={tmp_path / 'run'}'])\n"
              "print(rc, 'megatron.core' in sys.modules)")
    assert res.stdout.split() == ["2", "False"], res.stderr[-2000:]
    assert "already holds checkpoints: pass --resume" in res.stderr


def test_config_checks_cost_no_torch_import():
    # --print-config and a rejected --set answer in a tenth of a second: neither imports torch (the
    # CLI, the config sections and their validation are torch-free; the parallel-failure guard looks
    # the process group up in sys.modules).
    res = _py("import contextlib, io, sys\nfrom megatron_maspo.cli.main import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
              "    main(['train', '--print-config'])\n"
              "rc = main(['train', '--set', 'loss.method=nope'])\n"
              "print('loss:' in out.getvalue(), rc, 'torch' in sys.modules)")
    assert res.stdout.split() == ["True", "2", "False"], res.stderr[-2000:]


def test_launch_without_the_extra_names_it():
    res = _py("import sys\nsys.modules['nemo_run'] = None  # as if the launch extra were not installed\n"
              "from megatron_maspo.cli.main import main\n"
              "raise SystemExit(main(['launch', 'tiny', '--executor', 'local', '--dry-run']))")
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("maspo launch: error: ") and "pip install 'megatron-maspo[launch]'" in line


def test_only_user_errors_become_one_line(monkeypatch, capsys):
    import megatron_maspo.cli.plan as plan
    from megatron_maspo.errors import ConfigError, MissingPathError

    # main() configures this process's console (warning filters, PYTHONWARNINGS, Megatron's log level):
    # undo it after the test so later tests' subprocesses start clean.
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    monkeypatch.setattr(logging.getLogger("megatron.core"), "level", logging.NOTSET)

    for exc in (ConfigError("loss.alpha: bad"), MissingPathError("data.source='x': no such file")):
        monkeypatch.setattr(plan, "run", lambda args, exc=exc: (_ for _ in ()).throw(exc))
        assert main(["plan", "tiny"]) == 2
        assert capsys.readouterr().err == f"maspo plan: error: {exc}\n"
    # A ValueError or FileNotFoundError from inside the work is a bug to debug: its traceback stays.
    for exc in (ValueError("shape mismatch deep inside"), FileNotFoundError("/tmp/some/internal/file")):
        monkeypatch.setattr(plan, "run", lambda args, exc=exc: (_ for _ in ()).throw(exc))
        with pytest.raises(type(exc), match=str(exc)):
            main(["plan", "tiny"])


_IMPORTS = ("import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, "
            "megatron.core.distributed")


@pytest.mark.parametrize("verbose", [False, pytest.param(True, marks=pytest.mark.slow)])  # verbose: ~6 s more
def test_megatron_import_warnings_only_when_verbose(verbose):
    # The real imports that warn without Transformer Engine / Apex, in this process and in a child
    # (spawned ranks and grader workers inherit the filters through PYTHONWARNINGS).
    child = "" if verbose else f"\nsubprocess.run([sys.executable, '-c', {_IMPORTS!r}], check=True)"
    res = _py("import logging, subprocess, sys\nlogging.basicConfig()\n"
              "from megatron_maspo.cli.quiet import configure_console\n"
              f"configure_console({verbose})\n{_IMPORTS}{child}")
    assert res.returncode == 0, res.stderr[-2000:]
    noisy = [ln for ln in res.stderr.splitlines() if "Apex" in ln or "Transformer Engine" in ln
             or "Megatron-FSDP" in ln]
    if verbose:
        assert any("Apex is not installed" in ln for ln in noisy), res.stderr[-2000:]
    else:
        assert noisy == [], noisy


def test_print_config_shows_gspo_clip_range_and_rollout_correction():
    out = _run("train", "--print-config", "--set", "loss.method=gspo",
               "--set", "loss.rollout_correction.mode=icepop")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)["loss"]
    assert cfg["method"] == "gspo" and cfg["gspo"] == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert cfg["rollout_correction"]["mode"] == "icepop"
    bad = _run("train", "--print-config", "--set", "loss.rollout_correction.mode=mis")
    assert bad.returncode == 2 and "RolloutCorrectionParams.mode" in bad.stderr
    both = _run("train", "--print-config", "--set", "model.bf16=true", "--set", "model.fp16=true")
    assert both.returncode == 2 and "model.fp16" in both.stderr
