"""What differs between the megatron-core versions this project runs on, in one place.

The rest of the package imports the differences from here instead of testing versions itself. Each
helper probes the installed megatron-core (a signature, an attribute), never its version string, so an
untested patch release that keeps the same API needs no change here. See ``docs/stack.md`` for the
survey these entries come from and the ones still to add.

Entries:

- **RoPE's MLA flag.** ``rope_utils._apply_rotary_pos_emb_bshd`` / ``_apply_rotary_pos_emb_thd`` take
  ``multi_latent_attention=`` on 0.16.1; 0.19 renamed it ``mla_rotary_interleaved=`` (the old name is kept
  as a deprecated keyword that warns) and ``apply_rotary_pos_emb`` passes only the new name to the thd
  function. :func:`rope_mla_kwargs` spells the flag for the installed version; :func:`pop_rope_mla_flag`
  reads it from a call made with either spelling.
- **Core attention's key/value widths.** Multi-latent attention builds its core attention with
  ``k_channels=`` and ``v_channels=`` (key head 192 vs value head 128 in DeepSeek-V3). The local
  ``DotProductAttention`` of 0.16.1 takes neither; :func:`core_attention_channel_kwargs` passes them only
  to a version whose constructor names them.
- **MLA without Transformer Engine.** 0.16.1's ``multi_latent_attention.py`` sets its ``HAVE_TE`` when
  ``extensions.transformer_engine`` imports, which it does without TE (it puts a ``MagicMock`` in TE's
  place), then calls ``isinstance(linear_proj, TELinear)`` with that mock: every MLA build fails.
  :func:`mla_without_te` makes the module see what ``extensions.transformer_engine`` itself knows.
- **The MoE router without Transformer Engine.** 0.16.1's ``moe_utils`` binds ``te_general_gemm`` only
  inside its ``try: from ...transformer_engine import ...`` (the name is missing, not None, when the import
  fails), yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``: every MoE forward
  without TE raises NameError, on a GPU as on the CPU (seen on an H200 without TE).
  :func:`moe_router_without_te` binds the "absent" value the router expects.
- **How a pickled tensor names its storage loader.** ``import megatron.core`` on 0.19 rebinds
  ``torch.storage._load_from_bytes`` (a ``weights_only=False`` load) to
  ``megatron.core.safe_globals.safe_load_from_bytes`` (a ``weights_only=True`` one), so every tensor pickled
  in such a process (Transformer Engine's extra state among them) names the latter. 0.16.1 has no such
  function. :func:`storage_loader_globals` lists the names the installed version can write.
- **Per-layer checkpoint keys.** A block whose layers differ (Qwen3.5: linear and full attention) must
  checkpoint each layer under its own key instead of one tensor stacked over layers. 0.16.1's
  ``TransformerConfig`` spells the switch ``hetereogenous_dist_checkpoint`` (sic; its
  ``heterogeneous_block_specs`` also changes how layers are built, so it is not used);
  :func:`per_layer_checkpoint_kwargs` probes for that spelling and a corrected one.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

#: The old and new keyword of RoPE's MLA-style interleaving flag (0.16.1, then 0.19).
ROPE_MLA_OLD = "multi_latent_attention"
ROPE_MLA_NEW = "mla_rotary_interleaved"


@functools.cache
def rope_mla_kwarg() -> str:
    """The keyword the installed megatron-core's RoPE functions take for the MLA interleaving flag."""
    from megatron.core.models.common.embeddings import rope_utils

    params = inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters
    return ROPE_MLA_NEW if ROPE_MLA_NEW in params else ROPE_MLA_OLD


def rope_mla_kwargs(flag: bool) -> dict[str, bool]:
    """``{keyword: flag}`` for the installed megatron-core's ``_apply_rotary_pos_emb_*`` functions."""
    return {rope_mla_kwarg(): bool(flag)}


def pop_rope_mla_flag(kwargs: dict[str, Any], default: bool = False) -> bool:
    """The MLA interleaving flag of a RoPE call made with either spelling, removed from ``kwargs``.

    ``None`` counts as not given (0.19's default for the deprecated ``multi_latent_attention=``); when
    both are given, the old spelling wins, as it does inside megatron-core 0.19.
    """
    flag = default
    old = kwargs.pop(ROPE_MLA_OLD, None)
    new = kwargs.pop(ROPE_MLA_NEW, None)
    if new is not None:
        flag = new
    if old is not None:
        flag = old
    return bool(flag)


def core_attention_channel_kwargs(cls: type, k_channels: int | None,
                                  v_channels: int | None) -> dict[str, int | None]:
    """``{"k_channels": .., "v_channels": ..}`` when ``cls.__init__`` takes them, else ``{}`` (0.16.1's
    ``DotProductAttention``: the caller then handles the widths itself)."""
    params = inspect.signature(cls.__init__).parameters
    if "k_channels" in params and "v_channels" in params:
        return {"k_channels": k_channels, "v_channels": v_channels}
    return {}


def mla_without_te() -> None:
    """Align ``multi_latent_attention.HAVE_TE`` with whether Transformer Engine really imported
    (idempotent; a no-op where TE is installed or the module has no such flag)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    if hasattr(mla, "HAVE_TE") and not getattr(te_ext, "HAVE_TE", True):
        mla.HAVE_TE = False


def moe_router_without_te() -> None:
    """Bind ``moe_utils.te_general_gemm = None`` where the TE import failed before binding it (idempotent;
    a no-op where TE is installed or the version binds the name itself)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def megatron_core_version() -> str:
    """The installed megatron-core release, e.g. ``"0.19.2"``.

    0.19's ``package_info`` appends ``+<git head>`` of whatever repository its install directory sits in
    (it runs ``git rev-parse`` there at import), so a venv inside this project's checkout reports the
    *project's* commit; the label is dropped here.
    """
    from megatron.core.package_info import __version__

    return __version__.split("+")[0]


@functools.cache
def local_mla_without_q_latent() -> bool:
    """Whether the local (non-TE) spec can build MLA without a query latent (``q_lora_rank=None``).

    0.16.1: yes, the spec's modules are taken as given. 0.19 resolves MLA's norms and projections in
    ``transformer/mla_qk_norm_config.py``: with the latent KV norm on it requires the query projection to be
    a fused norm+linear, which only Transformer Engine provides, so the local spec cannot build it.
    """
    import importlib.util

    return importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is None


#: torch's own loader of a pickled storage (what every megatron-core version's pickles may name).
TORCH_STORAGE_LOADER = ("torch.storage", "_load_from_bytes")
#: megatron-core 0.19's replacement for it (``megatron/core/__init__.py`` rebinds torch's name to this).
MCORE_STORAGE_LOADER = ("megatron.core.safe_globals", "safe_load_from_bytes")


@functools.cache
def storage_loader_globals() -> frozenset[tuple[str, str]]:
    """The ``(module, name)`` globals a tensor pickled under the installed megatron-core may name for
    loading its storage from bytes: torch's always, megatron-core's where it defines one (0.19)."""
    from megatron.core import safe_globals

    names = {TORCH_STORAGE_LOADER}
    if callable(getattr(safe_globals, MCORE_STORAGE_LOADER[1], None)):
        names.add(MCORE_STORAGE_LOADER)
    return frozenset(names)


@functools.cache
def per_layer_checkpoint_kwargs() -> dict[str, bool]:
    """``TransformerConfig`` fields that make ``TransformerBlock`` checkpoint every layer under its own
    key (``layers.{i}.``), for blocks of unlike layers."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in ("hetereogenous_dist_checkpoint", "heterogeneous_dist_checkpoint"):
        if name in names:
            return {name: True}
    raise RuntimeError("this megatron-core has no per-layer checkpoint switch in TransformerConfig")
