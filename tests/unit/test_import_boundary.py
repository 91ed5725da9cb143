"""``import megatron_maspo`` and every CPU-path module work with vllm, transformer_engine and nemo_run absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CPU_MODULES = [
    "megatron_maspo", "megatron_maspo.config", "megatron_maspo.overrides", "megatron_maspo.loss",
    "megatron_maspo.parallel.logprobs", "megatron_maspo.parallel.groups", "megatron_maspo.parallel.cpu_compat",
    "megatron_maspo.model.provider", "megatron_maspo.model.hf_config", "megatron_maspo.conversion.megatron_to_hf",
    "megatron_maspo.conversion.hf_to_megatron", "megatron_maspo.reward.config", "megatron_maspo.data.tokenizer",
    "megatron_maspo.eval.metrics", "megatron_maspo.rollout.types", "megatron_maspo.rollout.builtin_engine",
    "megatron_maspo.rollout.weight_sync", "megatron_maspo.train.loop", "megatron_maspo.launch.plan",
    "megatron_maspo.cli.main",
]


def test_cpu_paths_import_without_optional_extras():
    code = textwrap.dedent(f"""
        import sys, importlib
        for m in ("vllm", "transformer_engine", "nemo_run"):
            sys.modules[m] = None  # makes any import of them raise ImportError
        from megatron_maspo.parallel.device import import_megatron_core
        import_megatron_core()  # as the entry points do: on CPU megatron-core's kernels compile on first call
        for name in {CPU_MODULES!r}:
            importlib.import_module(name)
        import torch
        from megatron.core import jit
        assert jit.jit_fuser is not torch.compile and "torch._inductor.compile_fx" not in sys.modules
        from megatron_maspo.cli.main import main
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = [m for m in ("vllm", "transformer_engine", "nemo_run", "math_verify")
                 if sys.modules.get(m) is not None]
        assert not heavy, heavy
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK" in out.stdout


def test_package_import_is_light():
    code = ("import sys, megatron_maspo, megatron_maspo.config, megatron_maspo.cli.main;"
            "print(int('megatron.core' in sys.modules), int('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "0"], "the config/CLI path must import neither megatron.core nor torch"
