"""Single-controller dispatch: what a driver process spends shipping each trainer call's batch (pure maths).

Some RL frameworks drive their trainer ranks from one controller process over Ray. NeMo-RL v0.3/v0.4
(``nemo_rl/distributed/worker_groups.py::run_all_workers_sharded_data`` and
``nemo_rl/models/policy/lm_policy.py`` at tag v0.3.0, commit b1c86a816c5e; unchanged at v0.4.0) does, per
trainer call (policy log-probs, reference log-probs, train):

    * the rollout batch is right-padded to its longest sequence S_pad (prompt + longest response),
    * each data-parallel shard is sent to every rank of its model-parallel group (``replicate_on_axes``
      = tensor, pipeline, context parallel), one pickled copy per rank (no ``ray.put``),
    * every rank's result is pulled back to the driver (``ray.get`` on all futures, then filtered).

Serialising (and deserialising the results) runs in the driver's one Python thread, so per call

    bytes   = R * B * S_pad * (b_in + b_out)         R = tp * pp * cp, B = sequences in the step
    seconds = bytes / controller_gb_s

with b_in / b_out the bytes per padded token slot of the fields sent / returned (the constants below,
from the v0.3.0 GRPO batch). Our trainer has no controller (every rank builds its own micro-batches), so
the planner leaves this term out unless ``Assumptions.controller_gb_s`` is set: it exists to plan (and to
calibrate against) runs of such frameworks. Later NeMo-RL releases put each shard once (PR #1944) and
pull one result per group (PR #3954), which removes R from the formula.

    python -m megatron_maspo.launch.plan.dispatch      # measure controller_gb_s on this machine
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass

LOGPROB_IN_BYTES = 8 + 8 + 4 + 4
"""Per token slot sent to a log-prob call: input_ids and token_mask (int64), advantages and
generation_logprobs (fp32); NeMo-RL v0.3.0 ``grpo.py`` builds ``train_data`` with these dtypes."""
LOGPROB_OUT_BYTES = 4
"""Per token slot returned by a log-prob call: fp32 log-probs [B, S_pad], from every rank."""
TRAIN_IN_BYTES = LOGPROB_IN_BYTES + 4 + 4
"""Per token slot sent to the train call: the above plus prev_logprobs and reference_policy_logprobs (fp32)."""


@dataclass(frozen=True, kw_only=True)
class DispatchLoad:
    """One trainer call's traffic through the controller."""

    seqs: int
    """B: sequences in the step (prompts x group size)."""
    padded_len: float
    """S_pad: the batch's padded length, its longest prompt + response."""
    replicas: int
    """R: ranks that each receive a full copy of one data-parallel shard (tp * pp * cp)."""
    in_bytes: float
    out_bytes: float


def dispatch_bytes(load: DispatchLoad) -> float:
    """Bytes the controller serialises and deserialises for one call (module docstring formula)."""
    return load.replicas * load.seqs * load.padded_len * (load.in_bytes + load.out_bytes)


def dispatch_seconds(load: DispatchLoad, controller_gb_s: float) -> float:
    """Seconds one call spends in the controller at ``controller_gb_s`` GB/s of (de)serialisation."""
    if controller_gb_s <= 0:
        raise ValueError(f"controller_gb_s must be > 0, got {controller_gb_s}")
    return dispatch_bytes(load) / (controller_gb_s * 1e9)


def step_dispatch_seconds(*, seqs: int, padded_len: float, replicas: int, reference: bool,
                          controller_gb_s: float) -> tuple[float, float]:
    """(old-logprob, update) seconds of dispatch per step: one or two log-prob calls, one train call."""
    lp = DispatchLoad(seqs=seqs, padded_len=padded_len, replicas=replicas, in_bytes=LOGPROB_IN_BYTES,
                      out_bytes=LOGPROB_OUT_BYTES)
    tr = DispatchLoad(seqs=seqs, padded_len=padded_len, replicas=replicas, in_bytes=TRAIN_IN_BYTES, out_bytes=0)
    calls = 2 if reference else 1
    return calls * dispatch_seconds(lp, controller_gb_s), dispatch_seconds(tr, controller_gb_s)


def measure_gb_s(seqs: int = 64, length: int = 16384, repeats: int = 5) -> float:
    """Measure the controller's rate here: pickle one log-prob call's shard (torch tensors, the dtypes
    above, as Ray pickles call arguments) and unpickle its fp32 result; best of ``repeats``, GB/s."""
    import torch

    shard = {"input_ids": torch.randint(0, 128_000, (seqs, length)), "token_mask": torch.ones(seqs, length,
             dtype=torch.int64), "advantages": torch.randn(seqs, length),
             "generation_logprobs": torch.randn(seqs, length), "input_lengths": torch.full((seqs,), length)}
    result = pickle.dumps({"logprobs": torch.randn(seqs, length)}, protocol=5)
    nbytes = seqs * length * (LOGPROB_IN_BYTES + LOGPROB_OUT_BYTES)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        pickle.dumps(shard, protocol=5)
        pickle.loads(result)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


if __name__ == "__main__":
    print(f"controller (de)serialisation: {measure_gb_s():.2f} GB/s (best of 5, one core, torch pickle)")
