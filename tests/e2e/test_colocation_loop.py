"""The training loop runs the colocation phases in order (issue 29, defect 7): per step, the trainer's
state is offloaded before the engine's KV cache wakes and generation starts, and reloaded only after the
engine slept. Issue 56: the gradients and optimizer state leave before the sync (which sees the
parameters on the device), and a due checkpoint is written before that, with the whole state resident.

Before the fix the sync woke the engine completely while the state was resident, and the state left
only at the next step. One CPU process, the tiny model, the built-in engine, every offload category on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.test_train_cli import MICRO

_SCRIPT = """
import json, sys
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.parallel.groups import destroy_parallel
from megatron_maspo.rollout.builtin_engine import BuiltinEngine
from megatron_maspo.train.actor import checkpoint as ckpt_mod
from megatron_maspo.train import loop as loop_mod
from megatron_maspo.train.actor.offload import StateOffloader

log = []
OFF = []  # the run's offloader, once built

def note(what):
    log.append([what, sorted(OFF[0].offloaded_categories) if OFF else []])

def wrap(cls, name, label=None):
    orig = getattr(cls, name)
    def f(self, *a, **k):
        if isinstance(self, StateOffloader) and not OFF:
            OFF.append(self)
        tag = label or name
        if name == "wake_up":
            tags = a[0] if a else k.get("tags")
            if not (set(tags or ("weights", "kv_cache")) & self._sleeping):
                return orig(self, *a, **k)
            tag = "wake_" + "+".join(tags or ["all"])
        if name == "offload" and (not self.enabled or self.fully_offloaded):
            return orig(self, *a, **k)
        if name == "reload" and not self.offloaded:
            return orig(self, *a, **k)
        note(tag)
        return orig(self, *a, **k)
    setattr(cls, name, f)

for n in ("sleep", "wake_up", "generate", "load_buckets"):
    wrap(BuiltinEngine, n)
for n in ("offload", "reload"):
    wrap(StateOffloader, n)
orig_save = loop_mod.Trainer.save
def save(self, *a, **k):
    note("save")
    orig_save(self, *a, **k)
loop_mod.Trainer.save = save
t = loop_mod.Trainer(resolve_config(None, None, sys.argv[1:]))
t.run()
destroy_parallel()
print("LOG=" + json.dumps(log))
"""

OFFLOAD = ["train.offload_params=true", "train.offload_grads=true", "train.offload_optimizer=true"]


def test_loop_offloads_before_the_kv_cache_wakes_and_reloads_after_the_engine_sleeps(tmp_path):
    sets = [*MICRO, *OFFLOAD, "train.steps=2", "checkpoint.save_every=0", "train.sft_steps=1",
            "rollout.sleep_level=2", f"checkpoint.run_dir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *sets], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    log = [(w, tuple(c)) for w, c in json.loads(out.stdout.split("LOG=")[-1])]
    every, state = ("grads", "optimizer", "params"), ("grads", "optimizer")
    start = [("offload", ()), ("sleep", every), ("reload", every)]  # the engine starts on offloaded memory
    # the sync: grads and optimizer leave first, the load (level 2: it re-allocates the weights) follows
    sync = [("offload", ()), ("load_buckets", state)]
    gen = [("offload", state), ("wake_kv_cache", every), ("generate", every), ("sleep", every), ("reload", every)]
    # the last step's checkpoint: after the update, before the sync, nothing on the host
    assert log == start + sync + gen + sync + gen + [("save", ())] + sync, log
    # The same run logs memory/* for every phase (test_train_memory.py's offloaded run, kept slow there).
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(recs) == 2
    for rec in recs:
        for phase in ("generate", "grade", "old_logprobs", "train", "sync"):
            for kind in ("peak_rss", "rss"):
                v = rec[f"memory/{phase}_{kind}_gb"]
                assert 0.01 < v < 64, (phase, kind, v)  # a Python process with torch holds > 10 MB
        assert rec["memory/offloaded_gb"] > 0
