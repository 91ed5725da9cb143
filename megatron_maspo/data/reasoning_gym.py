"""reasoning-gym generators as prompt data (the only module importing ``reasoning_gym``)."""

from __future__ import annotations

from megatron_maspo.data.example import Example, SkipLog


def reasoning_gym_examples(
    name: str, *, num_examples: int, seed: int, skips: SkipLog, **kwargs: object
) -> list[Example]:
    """Generate ``num_examples`` problems from ``reasoning_gym.create_dataset(name, ...)``.

    Args:
        name: generator name, e.g. ``"basic_arithmetic"``, ``"chain_sum"``, ``"gsm_symbolic"``.
        num_examples: dataset size.
        seed: generator seed (deterministic).
        skips: receives counts of entries without question or answer.
        **kwargs: generator options (``DataConfig.extra``).

    Raises:
        ImportError: the ``reasoning-gym`` extra is not installed (with the install command).
    """
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            f"DataConfig.source='reasoning_gym:{name}' needs reasoning-gym: "
            "pip install 'megatron-maspo[reasoning-gym]'"
        ) from e
    ds = reasoning_gym.create_dataset(name, size=num_examples, seed=seed, **kwargs)
    out = []
    for i in range(num_examples):
        entry = ds[i]
        q, a = str(entry.get("question") or "").strip(), str(entry.get("answer") or "").strip()
        if not q:
            skips.skip("empty_prompt", f"{name}[{i}]")
        elif not a:
            skips.skip("no_answer", f"{name}[{i}]")
        else:
            out.append(Example(prompt=q, answer=a, source=f"reasoning_gym/{name}"))
    return out
