"""Shared bases for the cluster recipes: the MASPO paper's setting (Fu et al. 2026, arXiv 2602.17550).

Every value is labelled with where it comes from (``SETTINGS``): ``"paper <section>"`` when the
paper's text states it, otherwise the verl / DAPO default or our own choice, named as such. The
paper's text does not give the learning rate, group size, sampling temperature / top-p, prompt
budget, step count or weight decay. The baselines' settings are said to be in its Table 4 (App. C.3),
which is missing from the text we have: only Clip-Higher's ε_high and Advantage Reweighting's α_A
(App. D.1) are known, so no other baseline value here is verified against the paper's runs.
Labels cite locations listed in `recipes/_paper_locations.py` (a test checks them).

**Evaluation.** §5.1 grades evaluation with prime_math and reports Avg@32 / Pass@32 on six
benchmarks; these recipes set ``eval.grader=prime_math`` (`reward/prime_grader.py`, the evaluation
grader's rules), so ``maspo eval`` of their runs and any ``eval.every`` evaluation grade as the paper
did (math-verify, the §5.1 *training* grader, stays the reward). They set no in-training evaluation
(``eval.every`` 0, no benchmarks), so no in-training Avg@32 exists unless ``eval.*`` is configured.

``table1(method, size)`` builds one cell of Table 1 (methods GRPO, Clip-Higher, DAC, Entropy
Advantage, BAPO, SAPO, MASPO, plus entropy regularisation and advantage reweighting) on
DeepSeek-R1-Distill-Qwen 1.5B / 7B (and 14B, §5.4); the recipe modules
``r1_distill_qwen_<size>_<method>`` are one-line calls of it. Layouts are the ones
``maspo plan <recipe> --nodes N --gpus-per-node 8`` accepts on 80 GB GPUs.

**MASPO's α at 1.5B.** Table 1's 7B row is α = 0.3 (= Table 5's α 0.3 / β 0.03 row) and §5.4 uses
0.5 at 14B; the paper states no α for the 1.5B main-table run. The only 1.5B value it states is
α = 0.5, in the β_high ablation (App. D.4), so the 1.5B recipes use 0.5 (the reference README also
suggests 0.5 for small models). ``--set loss.maspo.alpha=0.3`` gives the 7B value.
"""

from __future__ import annotations

import dataclasses

from megatron_maspo.config import MaspoConfig
from megatron_maspo.data.config import DataConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.params import AdvReweightParams, EntropyAdvParams, MaspoParams
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.overrides import set_path
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import CheckpointConfig, OptimConfig, TrainConfig

GPUS_PER_NODE = 8
DAPO_MATH = "/data/dapo-math-17k/dapo-math-17k.parquet"
"""Conventional location of DAPO-Math-17k on the cluster (mount it there or override data.source)."""
MAX_PROMPT_TOKENS = 1024
"""Prompt budget (our choice; the paper states only the 8192 maximum length)."""

DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be "
                 "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                 "\n\n{question}\n\nRemember to put your answer on its own line after \"Answer:\".")
"""DAPO-Math-17k's instruction around each problem. Training prompts come from the dataset as chat lists
(already wrapped); this template wraps the evaluation benchmarks' bare problems the same way, so
``maspo eval`` and ``eval.every`` prompt the model as training did. Check it against the mounted file."""
SETTINGS: dict[str, tuple[object, str]] = {
    # key: (value, source). "paper ..." = stated in arXiv 2602.17550; anything else is a default we chose.
    "data.source": (DAPO_MATH, "paper §5.1 (DAPO-Math-17k)"),
    "rollout.max_new_tokens": (8192, "paper App. C.1 / App. C.2 (maximum length 8192, read as the "
                                     "response budget)"),
    "train.prompts_per_step": (512, "paper §5.1 / App. C.3 (rollout batch 512)"),
    "train.mini_batches_per_step": (16, "paper §5.1 / App. C.3 (mini-batch 32 of 512 prompts)"),
    "optim.adam_beta1": (0.9, "paper App. C.3"),
    "optim.adam_beta2": (0.95, "paper App. C.3"),
    "optim.lr_decay_style": ("constant", "paper App. C.3 (constant lr)"),
    "optim.warmup_steps": (0, "paper App. C.3 (no warm-up)"),
    "loss.kl_coef": (0.0, "paper App. C.3 (β_KL = 0)"),
    "loss.grpo.eps_low": (0.2, "paper §5.1 (clip 0.2 for the baselines)"),
    "loss.grpo.eps_high": (0.2, "paper §5.1"),
    "loss.clip_higher.eps_high": (0.265, "paper App. D.1 (Clip-Higher ε_high 0.265)"),
    "loss.maspo.sigma_base": (1.0, "paper §5.3 (σ_base fixed at 1)"),
    "loss.maspo.beta_high": (0.03, "paper §5.3 / Table 5"),
    "loss.maspo.beta_low": (0.03, "paper §5.3 / Table 5"),
    "loss.std_unbiased": (False, "paper App. B (A⁺ = sqrt(n/x - 1) is the population-std advantage)"),
    "optim.lr": (1e-6, "DAPO's lr, our choice (not stated in the paper)"),
    "rollout.group_size": (8, "our choice (not stated in the paper; DAPO samples 16)"),
    "rollout.temperature": (1.0, "verl / DAPO default (not stated in the paper)"),
    "rollout.top_p": (1.0, "verl / DAPO default (not stated in the paper)"),
    "optim.weight_decay": (0.01, "verl default (not stated in the paper)"),
    "optim.clip_grad": (1.0, "verl default (not stated in the paper)"),
    "train.steps": (300, "our choice (not stated in the paper)"),
    "eval.grader": ("prime_math", "paper §5.1 (evaluation graded with prime_math)"),
    "data.prompt_template": (DAPO_TEMPLATE, "our choice: DAPO-Math-17k's own wrapper, for eval prompts"),
    "loss.grpo.dual_clip_c": (3.0, "verl default clip_ratio_c (whether the paper's baselines used it is "
                                   "unknown: Table 4 is missing from the text)"),
}
"""Where each shared value comes from; `paper_config` applies them and a test checks every
``paper`` label names a section, table or appendix."""

ADV_REWEIGHT = (AdvReweightParams(alpha=0.1), "paper App. D.1 (Advantage Reweighting α_A 0.1)")
"""Advantage Reweighting baseline's α_A, with its source (applied to that baseline only)."""
ENTROPY_REG_COEF = 0.001
"""Entropy-regularisation baseline's c_H: verl's former ``entropy_coeff`` default, our choice (the
paper does not state it)."""
ENTROPY_ADV = EntropyAdvParams(coef=0.4, kappa=2.0)
"""Entropy Advantage α 0.4, κ 2: values of the method's paper with GRPO (via a third-party
re-implementation), our choice (the MASPO paper does not state them)."""

SIZES = {
    # size: (HF folder, arch preset, nodes, tp, vllm_tp, MASPO α, where α comes from)
    "1p5b": ("/models/DeepSeek-R1-Distill-Qwen-1.5B", "r1-distill-qwen-1.5b", 1, 1, 1, 0.5,
             "paper App. D.4 (the only 1.5B α stated)"),
    "7b": ("/models/DeepSeek-R1-Distill-Qwen-7B", "r1-distill-qwen-7b", 4, 2, 1, 0.3,
           "paper Table 1 / Table 5"),
    "14b": ("/models/DeepSeek-R1-Distill-Qwen-14B", "r1-distill-qwen-14b", 4, 4, 2, 0.5, "paper §5.4"),
}

TABLE1 = ("grpo", "clip_higher", "dac", "entropy_adv", "bapo", "sapo", "maspo", "entropy_reg", "adv_reweight")
"""Methods with a recipe per size: Table 1's seven plus entropy regularisation and advantage
reweighting (both GRPO with a regulariser / modifier)."""


def paper_config(*, name: str, source: str, arch: str, alpha: float, nodes: int, tp: int = 1,
                 pp: int = 1, ep: int = 1, recompute: str | None = "full", vllm_tp: int = 1,
                 vllm_gpu_memory_utilization: float = 0.5) -> MaspoConfig:
    """MASPO in the paper's setting for one backbone and one layout (values from ``SETTINGS``).

    Args:
        name: run name; the run directory is ``runs/<name>``.
        source: Hugging Face folder of the backbone on the cluster.
        arch: ``megatron_maspo.model.presets`` name describing ``source`` (for planning off-cluster).
        alpha: MASPO mass exponent α.
        nodes: intended cluster size in 8-GPU nodes; sets ``parallel.world_size``.
        tp, pp, ep, recompute, vllm_tp, vllm_gpu_memory_utilization: the layout the planner accepts.
    """
    cfg = MaspoConfig(
        model=ModelConfig(source=source, arch=arch, bf16=True, recompute=recompute),
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, distributed_optimizer=True,
                                world_size=nodes * GPUS_PER_NODE),
        loss=LossConfig(method="maspo", maspo=MaspoParams(alpha=alpha), entropy_coef=0.0),
        optim=OptimConfig(min_lr=1e-6),
        rollout=RolloutConfig(engine="vllm", vllm_tp=vllm_tp, sleep_level=2,
                              vllm_gpu_memory_utilization=vllm_gpu_memory_utilization),
        data=DataConfig(format="dapo", max_prompt_tokens=MAX_PROMPT_TOKENS),
        train=TrainConfig(max_tokens_per_micro_batch=16384,
                          deterministic=False, seed=1234),
        checkpoint=CheckpointConfig(run_dir=f"runs/{name}", save_every=10, keep_last=2),
    )
    for key, (value, _) in SETTINGS.items():
        cfg = set_path(cfg, key, value)
    return cfg


FP8_ENGINES_OFFLOADED: tuple[tuple[str, object], ...] = (
    ("rollout.vllm_quantization", "fp8"),  # vLLM quantises each sync on load (docs/fp8-rollout.md)
    ("loss.tis_cap", 2.0),  # the engine samples a quantised policy: truncated IS against its log-probs
    ("train.offload_params", True), ("train.offload_grads", True), ("train.offload_optimizer", True),
)
"""The largest colocated recipes: FP8 engine weights, corrected by TIS, the trainer's state on the host while
the engine generates (docs/fp8-rollout.md)."""


def with_settings(cfg: MaspoConfig, settings) -> MaspoConfig:
    """``cfg`` with each ``(dotted key, value)`` of ``settings`` set, as ``--set`` would."""
    for key, value in settings:
        cfg = set_path(cfg, key, value)
    return cfg


def with_method(cfg: MaspoConfig, method: str, name: str) -> MaspoConfig:
    """The ``method`` cell of Table 1 on ``cfg``'s backbone: same everything but the loss and run dir."""
    loss = cfg.loss
    if method in ("grpo", "clip_higher", "dac", "bapo", "sapo", "maspo"):
        loss = dataclasses.replace(loss, method=method)
    elif method == "entropy_reg":
        loss = dataclasses.replace(loss, method="grpo", entropy_coef=ENTROPY_REG_COEF)
    elif method == "entropy_adv":
        loss = dataclasses.replace(loss, method="grpo", entropy_adv=ENTROPY_ADV)
    elif method == "adv_reweight":
        loss = dataclasses.replace(loss, method="grpo", adv_reweight=ADV_REWEIGHT[0])
    else:
        raise ValueError(f"unknown Table-1 method {method!r}; accepted: {TABLE1}")
    ckpt = dataclasses.replace(cfg.checkpoint, run_dir=f"runs/{name}")
    return dataclasses.replace(cfg, loss=loss, checkpoint=ckpt)


def table1(method: str, size: str) -> MaspoConfig:
    """Table-1 cell ``method`` on DeepSeek-R1-Distill-Qwen-``size`` ('1p5b', '7b', '14b')."""
    source, arch, nodes, tp, vllm_tp, alpha, _ = SIZES[size]
    name = f"r1-distill-qwen-{size.replace('p', '.')}-{method.replace('_', '-')}"
    cfg = paper_config(name=name, source=source, arch=arch, alpha=alpha, nodes=nodes, tp=tp, vllm_tp=vllm_tp)
    return with_method(cfg, method, name)


def grpo(cfg: MaspoConfig, name: str) -> MaspoConfig:
    """The GRPO baseline of a MASPO recipe: same everything, hard clip at 1 ± 0.2 (+ verl's dual-clip 3)."""
    return with_method(cfg, "grpo", name)
