"""Optimizer, RL-loop, checkpoint and logging settings: the trainer's config sections.

Torch-free and outside ``train/``, so the root ``config.py`` (which the planner, the launchers and the
lower rooms read) composes them without importing the trainer. ``train/config.py`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_maspo.model.ckpt_manifest import CHECKPOINT_SUBDIR as CHECKPOINT_SUBDIR


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with warmup + cosine/constant decay and global-norm clipping (Megatron optimizer)."""

    lr: float = 1e-6
    """Peak learning rate (MASPO paper: 1e-6)."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (verl/MASPO: 1.0); 0 disables it."""
    warmup_steps: int = 0
    """Linear warmup, in optimizer steps."""
    lr_decay_style: str = "constant"
    """``"constant"``, ``"cosine"`` or ``"linear"`` after warmup."""
    # --- fp16 loss scaling (model.fp16 only; Megatron OptimizerConfig's defaults) ---
    loss_scale: float | None = None
    """Static loss scale; None = Megatron's dynamic scaler."""
    initial_loss_scale: float = 2.0**16
    """Dynamic scaler's start; 2**16 (torch.amp.GradScaler's default; Megatron's 2**32 would skip
    about 2·16 more steps backing off, at hysteresis 2)."""
    min_loss_scale: float = 1.0
    """Dynamic scaler's floor (Megatron default 1)."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the scale doubles (Megatron default 1000)."""
    loss_scale_hysteresis: int = 2
    """Overflows tolerated before backing off (Megatron default 2)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr must be > 0 and 0 <= optim.min_lr <= lr, got {self.lr}, {self.min_lr}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("optim.adam_beta1 and optim.adam_beta2 must be in [0, 1)")
        if self.clip_grad < 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("optim.clip_grad, optim.warmup_steps and optim.weight_decay must be >= 0")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"optim.loss_scale={self.loss_scale} must be None or > 0")
        if not (self.initial_loss_scale >= self.min_loss_scale > 0 and self.loss_scale_window >= 1
                and self.loss_scale_hysteresis >= 1):
            raise ValueError("optim.initial_loss_scale >= optim.min_loss_scale > 0, loss_scale_window >= 1 "
                             "and loss_scale_hysteresis >= 1 are required")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r}; accepted: constant, cosine, linear")


@dataclass(kw_only=True)
class TrainConfig:
    """The RL loop: how many prompts, mini-batches and steps; warm start; determinism."""

    steps: int = 40
    """Rollout steps (each: generate, grade, several optimizer steps, weight sync)."""
    prompts_per_step: int = 16
    """Prompts per rollout step, B (paper: 512)."""
    mini_batches_per_step: int = 2
    """Optimizer steps per rollout step (paper: 16 = 512 / 32)."""
    max_tokens_per_micro_batch: int = 2048
    """Token budget of one packed micro-batch (prompt + response tokens)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and draw more prompts to refill the batch (DAPO)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: at most this many generation rounds per step."""
    overlong_filter: bool = False
    """Mask responses cut at ``max_new_tokens`` out of the loss (DAPO overlong filtering)."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty buffer L_cache in tokens (0 = off)."""
    sft_steps: int = 0
    """Supervised warm-start steps on the reference answers before RL (the tiny recipe uses it)."""
    sft_lr: float = 3e-3
    """Learning rate of the supervised warm start."""
    seed: int = 1234
    """Seeds data order, sampling and initialisation."""
    deterministic: bool = True
    """Deterministic algorithms and seeded sampling (CPU: a resumed run reproduces metrics exactly)."""
    check_first_ratio: bool = False
    """Assert |rho - 1| <= 1e-6 on the first mini-batch of every step (batch-invariance check)."""
    logprob_chunk_bytes: int | None = None
    """Workspace budget in bytes of the fused log-prob/entropy kernel: one ``[C, V/tp]`` logits
    tile plus two fp32 row-block temporaries; the chunk length C follows from it (so memory does not
    grow with V or T). None = 256 MiB on GPU, 64 MiB on CPU (docs/logprobs.md)."""
    logprob_kernel: str = "auto"
    """The fused log-prob/entropy kernel: ``"auto"`` = Triton (``parallel/logprobs_triton.py``: the logits
    never leave on-chip memory in forward) on CUDA when triton imports, else the torch chunk loop;
    ``"torch"`` / ``"triton"`` force one (``"triton"`` on a CPU needs ``TRITON_INTERPRET=1``: tests)."""
    reference_model: bool = False
    """Keep a frozen reference model for a KL term (only needed when loss.kl_coef > 0)."""
    offload_params: bool = False
    """Colocation: move the actor's parameters (and the reference model's) to pinned host memory while
    the engine generates, and back before training (bit-identical)."""
    offload_grads: bool = False
    """Colocation: the same for the gradient buffers (Megatron DDP ``grad_data``, fp32 main grads)."""
    offload_optimizer: bool = False
    """Colocation: the same for the optimizer state (fp32 master copies, Adam moments)."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "mini_batches_per_step", "max_tokens_per_micro_batch",
                     "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompts_per_step % self.mini_batches_per_step:
            raise ValueError(f"train.prompts_per_step={self.prompts_per_step} must be divisible by "
                             f"train.mini_batches_per_step={self.mini_batches_per_step}")
        if self.logprob_chunk_bytes is not None and self.logprob_chunk_bytes < 1:
            raise ValueError(f"train.logprob_chunk_bytes must be >= 1 or None, got "
                             f"{self.logprob_chunk_bytes}")
        if self.logprob_kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"train.logprob_kernel={self.logprob_kernel!r}; accepted: auto, torch, triton")
        if self.sft_steps < 0 or self.overlong_buffer < 0:
            raise ValueError("train.sft_steps and train.overlong_buffer must be >= 0")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often training state is saved."""

    run_dir: str = "runs/maspo"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, checkpoints, plots."""
    save_every: int = 10
    """Checkpoint every N rollout steps (0 = only at the end and on SIGTERM/SIGINT)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a newer one is complete."""
    auto_resume: bool = False
    """Resume from the run directory's latest complete checkpoint when it holds one, without
    ``--resume`` (a requeued Slurm job restarts the same command). Off: a fresh run refuses a run
    directory with checkpoints. ``maspo launch --executor slurm`` turns it on."""
    save_warm_start: bool = False
    """Also save ``checkpoints/step_0`` right after the SFT warm start (``train.sft_steps``): the
    warm-started weights, from which other runs, at any TP/PP/CP layout, start with
    ``model.megatron_checkpoint=<run_dir>/checkpoints/step_0 train.sft_steps=0`` (a layout comparison
    from identical weights, docs/attention.md). Kept like any checkpoint (``keep_last``)."""

    min_free_mb: int | None = None
    """Free space (MiB) the run directory's disk must have before training starts. None = room for one
    more checkpoint: on a resume the last one's size, on a fresh run an estimate from the model (16 bytes
    per parameter: weights, fp32 master copy, both Adam moments; plus 16 MiB). 0 skips the free-space
    check (the run directory must still be writable)."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("checkpoint.run_dir must not be empty")
        if self.min_free_mb is not None and self.min_free_mb < 0:
            raise ValueError(f"checkpoint.min_free_mb must be >= 0 or None, got {self.min_free_mb}")
        if self.save_every < 0 or self.keep_last < 1:
            raise ValueError("checkpoint.save_every must be >= 0 and checkpoint.keep_last >= 1")


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics sinks."""

    tensorboard: bool = True
    """Write TensorBoard events (if tensorboard is installed; a warning otherwise)."""
    wandb_project: str | None = None
    """W&B project; None disables W&B."""
    plots: bool = True
    """Write PNG plots of reward, entropy, length and gate statistics at the end."""
    progress: bool = True
    """Console progress on rank 0 when it is a terminal: a bar over steps with ETA and live bars in
    generation, grading and updates (a log file or CI gets one plain line per step either way)."""
