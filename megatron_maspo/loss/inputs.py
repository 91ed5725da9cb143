"""`LossInputs`: what one packed micro-batch gives the policy loss, in one object.

The actor's training forward yields ``logprobs`` (and ``entropy``) of the response tokens; the
packed micro-batch carries the rest (old / reference / rollout log-probs, advantages, the mask, the
response and prompt index of every token); the mini-batch plan adds the global counts the
aggregation divides by. `policy.compute_policy_loss`, `reduce.aggregate` and
`group_stats.mini_batch_stats` read them from here instead of re-spelling them parameter by
parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True, frozen=True, slots=True)
class LossInputs:
    """Flat ``[T]`` tensors of one packed micro-batch (T response tokens), plus global counts.

    Every tensor is ``[T]`` on the same device, unsharded (TP and CP ranks each see the whole
    ``[T]`` of their micro-batch); a response's tokens must all be in one ``LossInputs``
    (sequence-level terms: GSPO's ratio, seq-mean-* aggregation, the ``seq_mask`` correction).
    Optional tensors are None when the chosen options do not need them; `compute_policy_loss`
    names the option that makes one required.
    """

    logprobs: torch.Tensor
    """[T] fp32, log π_θ of the sampled tokens at the rollout temperature; the only input that
    carries gradient."""
    old_logprobs: torch.Tensor
    """[T] fp32, log π_old (trainer-recomputed, temperature-scaled); detached inside the loss."""
    advantages: torch.Tensor
    """[T] fp32, Â per token (the response's advantage broadcast); detached inside the loss."""
    mask: torch.Tensor
    """[T] bool (or 0/1 numeric), valid response tokens."""
    num_tokens_global: float
    """N, valid tokens of the whole mini-batch (all micro-batches and DP×CP ranks), counted before
    the first forward; the token-mean divisor and the metrics' divisor. 0 is clamped to 1."""
    num_seqs_global: float | None = None
    """S, responses of the whole mini-batch (the seq-mean-* aggregations' divisor)."""
    seq_ids: torch.Tensor | None = None
    """[T] int64, response index of each token (seq-mean-token-mean, QUATRO REPS, GSPO's sequence
    ratio, the ``seq_mask`` rollout correction)."""
    prompt_ids: torch.Tensor | None = None
    """[T] int64, prompt (group) index of each token (QUATRO's per-prompt duals)."""
    entropy: torch.Tensor | None = None
    """[T] fp32, H_t of π_θ; with gradient when ``entropy_coef > 0``, used detached by the Entropy
    Advantage; ``policy/entropy_mean`` is reported whenever it is given."""
    ref_logprobs: torch.Tensor | None = None
    """[T] fp32, log π_ref of the frozen reference (needed when ``kl_coef > 0``)."""
    rollout_logprobs: torch.Tensor | None = None
    """[T] fp32, the rollout engine's log-probs (needed when a rollout correction is on)."""
    batch_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Statistics over whole groups / the whole mini-batch computed before the loss call
    (`group_stats.py`): 0-d ``bapo/{c_low,c_high,pos_share}``, [T] ``quatro/lambda``. They replace
    BAPO's per-call bound search and QUATRO's per-call λ_q."""

    def token_tensors(self) -> dict[str, torch.Tensor | None]:
        """The ``[T]`` inputs by name, in the order `registry.check_token_inputs` reports them."""
        return {"logprobs": self.logprobs, "old_logprobs": self.old_logprobs,
                "advantages": self.advantages, "mask": self.mask, "seq_ids": self.seq_ids,
                "entropy": self.entropy, "ref_logprobs": self.ref_logprobs,
                "rollout_logprobs": self.rollout_logprobs, "prompt_ids": self.prompt_ids}
