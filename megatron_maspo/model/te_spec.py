"""Transformer Engine layer spec (GPU only; the one module that imports transformer_engine).

Kept thin on purpose: Megatron-Core ships the spec; we only select it. Not runnable on CPU, covered
by tests marked ``te``.
"""

from __future__ import annotations

from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.device import on_cuda


def te_available() -> bool:
    """True when Transformer Engine imports and CUDA is present (TE has no CPU kernels)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return on_cuda()


def require_te() -> None:
    """Raise unless the TE path can run here: Transformer Engine imports and CUDA is present.

    Raises:
        ImportError: Transformer Engine is missing (with the install hint).
        RuntimeError: no CUDA device (TE has no CPU kernels).
    """
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:
        raise ImportError("model.attention_backend='te' needs Transformer Engine: pip install "
                          "'megatron-maspo[te]' on a CUDA machine; or use attention_backend="
                          "'packed_sdpa'") from e
    if not on_cuda():
        raise RuntimeError("model.attention_backend='te' needs a CUDA device (Transformer Engine has no "
                           "CPU kernels); use attention_backend='packed_sdpa'")


def te_layer_spec(spec: ArchSpec, *, grouped_gemm: bool):
    """Megatron's TE GPT layer spec for ``spec``; ``grouped_gemm`` (``provider.moe_grouped_gemm``) is the
    same value the ``TransformerConfig`` gets, so ``TEGroupedMLP`` (``linear_fc1.weight{j}``) and the
    config agree (``model/te_names.py`` for the names).

    Raises:
        ImportError: Transformer Engine is missing, with the install hint.
    """
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:  # pragma: no cover - GPU only
        raise ImportError("Transformer Engine is required for the TE layer spec: "
                          "pip install 'megatron-maspo[te]' (CUDA machines only)") from e
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=spec.num_moe_experts, moe_grouped_gemm=grouped_gemm and bool(spec.num_moe_experts),
        qk_layernorm=spec.qk_layernorm or spec.is_mla, multi_latent_attention=spec.is_mla)


def te_import_error() -> str | None:
    """Why ``import transformer_engine.pytorch`` fails (its extension is built against the local torch)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 (an undefined symbol is an OSError/ImportError: any reason counts)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None
