"""Logits parity between a Megatron model and its HF counterpart (``--verify`` and tests).

The error figure is ``max|logits_megatron - logits_hf| / max|logits_hf|`` over all prompts,
positions and (unpadded) vocabulary entries: a relative error that is not blown up by logits
near zero.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_maspo.conversion.plan import unwrap
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


@torch.no_grad()
def megatron_logits(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups,
                    tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, V]`` (fp32) of ``tokens`` ``[b, s]`` through the pipeline.

    Collective over the model's TP and PP groups; a plain stage-by-stage forward (no micro-batching,
    no VPP). Returns the logits on last-stage ranks, ``None`` elsewhere.
    """
    if len(chunks) != 1:
        raise ValueError(f"megatron_logits supports one chunk per rank (no VPP); got {len(chunks)}")
    model = unwrap(chunks[0])
    model.eval()
    param = next(model.parameters())
    tokens = tokens.to(param.device)  # callers build token ids on the CPU
    b, n = tokens.shape
    sp = groups.tp if model.config.sequence_parallel else 1
    # sequence parallelism splits the sequence over TP: pad on the right (causal: the first n positions
    # do not see the padding) and drop the padded positions' logits
    tokens = torch.nn.functional.pad(tokens, (0, -n % sp))
    s = tokens.shape[1]
    pos = torch.arange(s, device=param.device).expand(b, s)
    if not groups.is_first_stage:
        hidden = torch.empty(s // sp, b, spec.hidden_size, dtype=param.dtype, device=param.device)
        comm.recv(hidden, src=dist.get_global_rank(groups.pp_group, groups.pp_rank - 1),
                  group=groups.pp_group)
        model.set_input_tensor(hidden)
    out = model(tokens, pos, None)
    if not groups.is_last_stage:
        comm.send(out, dst=dist.get_global_rank(groups.pp_group, groups.pp_rank + 1),
                  group=groups.pp_group)
        return None
    if groups.tp > 1:  # vocab-parallel [b, s, Vp/t] -> [b, s, Vp]
        out = torch.cat(comm.all_gather(out, group=groups.tp_group), dim=-1)
    return out[:, :n, : spec.vocab_size].float()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, V]`` (fp32) of a transformers causal LM (``tokens`` moved to its device)."""
    return model(input_ids=tokens.to(model.device)).logits.float()


def max_relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|``; ``ValueError`` on a shape mismatch."""
    if got.shape != ref.shape:
        raise ValueError(f"logits shapes differ: {tuple(got.shape)} vs {tuple(ref.shape)}")
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def verify_prompts(vocab_size: int, *, n: int = 3, seq_len: int = 24, seed: int = 0,
                   tokenizer=None) -> torch.Tensor:
    """A few prompts ``[n, seq_len]``: tokenized text when a tokenizer is given, else random ids."""
    if tokenizer is not None:
        texts = ["The capital of France is Paris, and the capital of Italy is",
                 "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "Question: what is 12 + 30? Answer: the sum is"][:n]
        ids = [tokenizer(t)["input_ids"] for t in texts]
        m = min(len(i) for i in ids)
        return torch.tensor([i[:m] for i in ids])
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, seq_len), generator=g)
