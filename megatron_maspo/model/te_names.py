"""Parameter names of the Transformer Engine GPT layer spec, recorded from megatron-core 0.16.1's and 0.19.2's
sources (the names are the same in both; the source lines that decide them moved, see ``VERSION_SOURCES``).

Transformer Engine cannot be built on a machine without CUDA, so the TE spec's module and parameter names
are written down here, each next to the source line that decides it, and
``tests/unit/model/test_te_names.py`` checks every such line against the installed megatron-core text (an
upgrade that renames a module or a parameter fails there, not on the cluster). Sources, under
``megatron/core/``:

* ``models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_with_transformer_engine_spec``): ``linear_qkv`` is the
  backend's ``column_parallel_layer_norm_linear`` (the input norm is fused into it, ``input_layernorm`` is
  left an ``IdentityOp``); ``pre_mlp_layernorm`` is a separate norm only for MoE layers; the dense MLP's
  ``linear_fc1`` fuses its norm too (``get_mlp_module_spec_for_backend``).
* ``extensions/transformer_engine_spec_provider.py`` (``TESpecProvider``): those are
  ``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, ``TENorm``, ``TEDotProductAttention``; with
  ``moe_grouped_gemm`` the experts are ``TEGroupedMLP`` over ``TEColumnParallelGroupedLinear`` /
  ``TERowParallelGroupedLinear``, else ``SequentialMLP`` of ``TEColumnParallelLinear`` / ``TERowParallelLinear``.
* ``extensions/transformer_engine.py``: ``TELayerNormColumnParallelLinear`` subclasses TE's
  ``LayerNormLinear``, whose norm parameter is ``layer_norm_weight``; ``TEGroupedLinear`` (TE's
  ``GroupedLinear``) holds one parameter per local expert, ``weight{i}`` (its sharded state dict maps
  ``weight{gemm_idx}`` to per-expert keys). Every TE module also carries an ``_extra_state`` entry (FP8
  metadata) in its state dict.
* megatron-core 0.19 builds the grouped experts with ``GroupedMLPSubmodules`` instead of ``MLPSubmodules``
  and gives ``TEGroupedLinear`` an option to hold all experts in one ``weight`` tensor
  (``moe_single_grouped_weight``); it is off by default and this project never sets it, so the parameters
  stay ``weight{i}`` (a load hook converts checkpoints between the two layouts).

Mapping (local spec name -> TE spec name, per decoder layer; all other names are the same in both)::

    input_layernorm.weight                          -> self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight         (dense layer)  -> mlp.linear_fc1.layer_norm_weight
    pre_mlp_layernorm.weight         (MoE layer)    -> pre_mlp_layernorm.weight            (TENorm)
    mlp.experts.local_experts.{j}.linear_fc{k}.weight
                                     (grouped GEMM) -> mlp.experts.linear_fc{k}.weight{j}  (TEGroupedMLP)
                                     (sequential)   -> unchanged                          (SequentialMLP)
"""

from __future__ import annotations

import re

MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")
"""The releases whose sources were read for this table (the same two CI runs)."""

SOURCES: tuple[tuple[str, str], ...] = (
    # (file under megatron/core, text that must appear in it): the facts the mapping above relies on,
    # in every recorded release
    ("models/gpt/gpt_layer_specs.py", "linear_qkv=backend.column_parallel_layer_norm_linear(),"),
    ("models/gpt/gpt_layer_specs.py", "pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp,"),
    ("models/gpt/gpt_layer_specs.py", "linear_fc1 = backend.column_parallel_layer_norm_linear()"),
    ("models/gpt/gpt_layer_specs.py", '"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight",'),
    ("extensions/transformer_engine_spec_provider.py", "return TELayerNormColumnParallelLinear"),
    ("extensions/transformer_engine.py", "class TELayerNormColumnParallelLinear(te.pytorch.LayerNormLinear):"),
    ("extensions/transformer_engine.py", "norm_layer.weight.copy_(fused_layer.layer_norm_weight)"),
    ("extensions/transformer_engine.py", "class TEGroupedLinear(te.pytorch.GroupedLinear):"),
    ("extensions/transformer_engine.py", 'f"{prefix}weight{gemm_idx}": sub_sd[f"{gemm_idx}.weight"]'),
    ("transformer/moe/experts.py", "class TEGroupedMLP(MegatronModule):"),
)
"""Source lines behind every rename; the test reads each file and looks for the text verbatim."""

VERSION_SOURCES: dict[str, tuple[tuple[str, str], ...]] = {
    "0.16": (
        ("extensions/transformer_engine_spec_provider.py", "return TEGroupedMLP, MLPSubmodules("),
        ("extensions/transformer_engine_spec_provider.py", "linear_fc1=TEColumnParallelGroupedLinear, "
                                                            "linear_fc2=TERowParallelGroupedLinear"),
        ("extensions/transformer_engine_spec_provider.py", "return SequentialMLP, MLPSubmodules(\n"
                                                            "                linear_fc1=TEColumnParallelLinear"),
        ("extensions/transformer_engine.py", 'full_state_dict[f"weight{gemm_idx}"]'),
    ),
    "0.19": (
        ("extensions/transformer_engine_spec_provider.py", "TEGroupedMLP,\n                submodules=GroupedMLPSubmodules(\n"
                                                            "                    linear_fc1=TEColumnParallelGroupedLinear,\n"
                                                            "                    linear_fc2=TERowParallelGroupedLinear,"),
        ("extensions/transformer_engine_spec_provider.py", "SequentialMLP,\n                submodules=MLPSubmodules(\n"
                                                            "                    linear_fc1=TEColumnParallelLinear,"),
        ("extensions/transformer_engine.py", 'extra_kwargs["single_grouped_weight"] = getattr(\n'
                                              '                    config, "moe_single_grouped_weight", False'),
        ("extensions/transformer_engine.py", 'f"{prefix}{param_name}{gemm_idx}" for gemm_idx in range(self.num_gemms)'),
    ),
}
"""Per minor: the lines that moved between the recorded releases (the test checks the installed one's)."""

_LAYER = r"(?P<pre>(?:.*\.)?decoder\.layers\.\d+\.)"
_EXPERT_LOCAL = re.compile(_LAYER + r"mlp\.experts\.local_experts\.(?P<j>\d+)\.(?P<fc>linear_fc[12])\.weight$")
_EXPERT_GROUPED = re.compile(_LAYER + r"mlp\.experts\.(?P<fc>linear_fc[12])\.weight(?P<j>\d+)$")

FUSED_NORMS: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Local-spec norm -> the TE parameter it is fused into (dense layers; MoE keeps ``pre_mlp_layernorm``)."""


def te_name(local: str, *, moe_layer: bool, grouped_gemm: bool) -> str:
    """The TE spec's name of the parameter the local spec calls ``local`` (module docstring's table).

    Args:
        local: a parameter name of a local-spec ``GPTModel`` chunk, e.g.
            ``decoder.layers.0.input_layernorm.weight``.
        moe_layer: the layer has routed experts (its ``pre_mlp_layernorm`` stays a separate TENorm).
        grouped_gemm: the experts are ``TEGroupedMLP`` (``moe_grouped_gemm=True``).
    """
    if grouped_gemm and (m := _EXPERT_LOCAL.match(local)):
        return f"{m['pre']}mlp.experts.{m['fc']}.weight{m['j']}"
    for norm, fused in FUSED_NORMS.items():
        if local.endswith("." + norm) and ".decoder.layers." in "." + local:
            if norm == "pre_mlp_layernorm.weight" and moe_layer:
                return local
            return local[: -len(norm)] + fused
    return local


def local_name(name: str) -> str:
    """Inverse of :func:`te_name`: any TE or local spelling -> the local spec's name (identity on local)."""
    if m := _EXPERT_GROUPED.match(name):
        return f"{m['pre']}mlp.experts.local_experts.{m['j']}.{m['fc']}.weight"
    for norm, fused in FUSED_NORMS.items():
        if name.endswith("." + fused):
            return name[: -len(fused)] + norm
    return name


def spellings(local: str) -> tuple[str, ...]:
    """Every name a parameter called ``local`` in the local spec may have in a built chunk: local, TE
    (fused norm or separate), TE grouped GEMM; the conversion tables resolve through these."""
    out = [local]
    for moe_layer, grouped in ((False, False), (False, True), (True, True)):
        alt = te_name(local, moe_layer=moe_layer, grouped_gemm=grouped)
        if alt not in out:
            out.append(alt)
    return tuple(out)
