"""The `[train]`, `[sft]` and `[distributed]` sections: optimisation, the supervised warm start, the ranks' layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from exactrl.config.errors import _check_at_least, _check_nonneg, _check_positive, _fail

LRSchedule = Literal["constant", "cosine", "linear"]
FsdpFp8Copies = Literal["kept", "per_use"]


@dataclass
class TrainConfig:
    """Optimisation of the policy (and the PPO critic): steps, AdamW, schedule, microbatching, checkpoints."""

    steps: int = 100
    """Number of RL optimizer steps (each consumes algorithm.rollouts_per_step rollouts)."""
    lr: float = 1e-5
    """Peak learning rate of the policy."""
    critic_lr: float = 1e-5
    """Peak learning rate of the PPO critic."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value."""
    warmup_steps: int = 0
    """Linear learning-rate warmup from 0 over this many steps."""
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: "constant", or "cosine" / "linear" decay to 0 at the last step."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed forward/backward microbatch (gradients are accumulated across them)."""
    fsdp_tokens_per_microbatch: int | None = None
    """Under torchrun (FSDP2), at any world size (`--nproc 1` included): the sharded trainer's microbatch
    token budget. Each FSDP2 microbatch pays a round of per-layer all-gathers and reduce-scatters and runs
    without CUDA graphs, so fewer, larger ones are faster (qwen3-0.6b on one H100, 2026-11-26: 1.98x the
    tokens/s at 32,768 tokens than at 8,192). Unset = on GPUs, with engine.release_memory on, the largest of 32768 and
    16384 (above max_tokens_per_microbatch) that the memory plan fits with 10% of the device to spare, else
    max_tokens_per_microbatch; on CPU ranks max_tokens_per_microbatch. Ignored on one device without torchrun.
    Episode and SFT length limits keep following max_tokens_per_microbatch."""
    fsdp_reduce: Literal["minibatch", "microbatch"] = "minibatch"
    """Under torchrun (FSDP2): when the gradients are reduce-scattered. "minibatch": once, after a minibatch's last
    microbatch; until then each rank accumulates the gradients of every trained parameter unsharded, in fp32 (4
    bytes per trained parameter of the whole model on each rank, the memory plan's fsdp_accumulated_grads).
    "microbatch": after every microbatch, the shards accumulating (1/N of that): a round of reduce-scatters per
    microbatch, and the gradient summed in another (fixed) order, so not the bits of "minibatch"; what a model
    whose fp32 gradients do not fit beside its shards needs (qwen3-30b-a3b on 2 x H200). One microbatch a
    minibatch: the same either way."""
    cuda_graphs: bool = True
    """Replay each microbatch's forward, loss and backward from a CUDA graph (ignored on CPU). Microbatches are
    then padded to a few bucket shapes; padding never reaches the loss."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's inputs from the forward and recompute the layer in the backward
    (torch.utils.checkpoint, non-reentrant): less activation memory for about one more forward. Exact either way:
    the recomputation runs the same kernels on the same inputs, so losses and gradients are bitwise the same."""
    fsdp_fp8_copies: FsdpFp8Copies = "kept"
    """Under torchrun (FSDP2) with model.precision = "fp8": the trainer's fp8 copies of its gathered projection
    weights (and its KL reference's and critic's). "kept": each copy is kept from one step to the next, marked
    stale by each step (and by a sharded checkpoint's load) and re-quantized at the next forward (a frozen LoRA base's
    or reference's, once a run): the whole model's copies on
    every rank, about 1 byte a projection weight (qwen3-30b-a3b: 30.8 GB a rank). "per_use": each op quantizes its
    gathered weight for its own call and drops the copy (one op's copy at a time: 0.62 GB there), but every
    forward quantizes every projection weight again (each microbatch's, each scoring pass's, the recompute of
    activation checkpointing), a cost not yet timed on a GPU (docs/fp8.md). The same logprobs bit for bit either
    way. The memory plan counts what each holds (a refused plan names "per_use" where it would fit). Ignored
    without torchrun (one device) and with model.precision = "dtype"."""
    offload: Literal["none", "optimizer"] = "none"
    """Where the policy's (and critic's) fp32 master weights and AdamW moments wait between optimizer steps:
    "none" = on the device; "optimizer" = in pinned host memory, brought to the device for each step (12 bytes
    per trainable parameter off the device during generation and the forward/backward, for two copies of them per
    step). Under torchrun (FSDP2) the fp32 shards stay on the device and each rank's AdamW moment shards move (8
    bytes per element of its shard). The same bits either way. `exactrl plan` shows what it saves."""
    check_memory: bool = True
    """On a CUDA device, check the memory plan (`exactrl plan`) before anything loads and refuse a run whose
    generation, training or optimizer phase is predicted not to fit, naming the settings that would; false
    skips the check (the plan's activation term is an estimate)."""
    save_every: int = 50
    """Save a checkpoint every this many steps (and always at the end); 0 = only at the end."""
    save_at_end: bool = True
    """Write a checkpoint when the run reaches train.steps (false: only save_every's and Ctrl-C's, e.g. for a
    benchmark of a large model whose checkpoint would take long to write)."""
    keep_checkpoints: int = 2
    """Number of most recent checkpoints kept on disk; older ones are deleted."""
    max_nan_steps: int = 3
    """Abort after this many consecutive steps with a non-finite loss or gradient (those steps are skipped)."""
    moe_aux_loss_coef: float = 0.0
    """Mixture of experts: weight of the router's load-balancing loss (the Switch loss transformers scales by a
    checkpoint's `router_aux_loss_coef`, e.g. 0.001), added to the policy loss per microbatch. Off by default in
    RL: a pretrained router is already balanced, and a second objective beside the reward moves the routing, hence
    the sampling policy, for reasons the reward does not see; turn it on when `moe/load_max_over_mean` drifts up.
    It changes no logprob (the exactness check is unaffected); the `moe/*` metrics are logged either way."""
    moe_z_loss_coef: float = 0.0
    """Mixture of experts: weight of the router z-loss (ST-MoE: mean over tokens and sparse layers of
    logsumexp(router logits)^2), which keeps router logits small; e.g. 0.001. Off by default for the reason above."""

    def validate(self) -> None:
        _check_at_least(self.steps, 0, "train.steps")
        _check_nonneg(self.moe_aux_loss_coef, "train.moe_aux_loss_coef")
        _check_nonneg(self.moe_z_loss_coef, "train.moe_z_loss_coef")
        _check_positive(self.lr, "train.lr")
        _check_positive(self.critic_lr, "train.critic_lr")
        _check_nonneg(self.weight_decay, "train.weight_decay")
        if len(self.betas) != 2:
            _fail("train.betas", f"must have exactly 2 values, got {len(self.betas)}")
        for i, b in enumerate(self.betas):
            if not (0 <= b < 1):
                _fail(f"train.betas[{i}]", f"must be in [0, 1), got {b!r}")
        _check_positive(self.grad_clip, "train.grad_clip")
        _check_at_least(self.warmup_steps, 0, "train.warmup_steps")
        _check_at_least(self.max_tokens_per_microbatch, 1, "train.max_tokens_per_microbatch")
        if self.fsdp_tokens_per_microbatch is not None:
            _check_at_least(self.fsdp_tokens_per_microbatch, 1, "train.fsdp_tokens_per_microbatch")
        # (A config built in code: the loader checks a file's value against the Literal itself.)
        if self.fsdp_fp8_copies not in get_args(FsdpFp8Copies):
            one_of = " or ".join(f'"{a}"' for a in get_args(FsdpFp8Copies))
            _fail("train.fsdp_fp8_copies", f"must be {one_of}, got {self.fsdp_fp8_copies!r}")
        _check_at_least(self.save_every, 0, "train.save_every")
        _check_at_least(self.keep_checkpoints, 1, "train.keep_checkpoints")
        _check_at_least(self.max_nan_steps, 0, "train.max_nan_steps")


@dataclass
class SFTConfig:
    """Optional supervised warm start on the task's reference answers before RL."""

    steps: int = 0
    """Supervised fine-tuning steps before RL; 0 = no SFT warm start."""
    lr: float = 1e-3
    """SFT learning rate (AdamW, using train.betas and train.weight_decay)."""
    batch_size: int = 32
    """Prompt/answer pairs per SFT step."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many SFT steps."""
    checkpoint: str | None = None
    """Start RL from this existing SFT checkpoint directory instead of running SFT."""
    save_every: int = 100
    """Write a resumable SFT checkpoint (weights, optimizer, data position) to <output_dir>/sft-checkpoints every this many SFT steps; 0 = only when the run is stopped (Ctrl-C, SIGTERM). `--resume` continues SFT from the last one; they are removed once SFT has finished."""

    def validate(self) -> None:
        _check_at_least(self.steps, 0, "sft.steps")
        _check_positive(self.lr, "sft.lr")
        _check_at_least(self.batch_size, 1, "sft.batch_size")
        _check_at_least(self.warmup_steps, 0, "sft.warmup_steps")
        _check_at_least(self.save_every, 0, "sft.save_every")
        if self.checkpoint is not None and self.steps > 0:
            _fail("sft.checkpoint", "and sft.steps > 0 are exclusive: load a checkpoint or run SFT, not both")


@dataclass
class DistributedConfig:
    """The layout of a torchrun run's ranks: every rank colocated (engine and trainer take turns), or generator ranks apart."""

    generator_ranks: int = 0
    """Under torchrun: how many ranks (the last ones) run only the rollout engine, while the others run only the trainer (FSDP2 among themselves) and send it their new weights after every update; 0 = colocated (every rank holds an engine replica and a trainer shard). With G generators and N trainers a run's metrics and weights equal the colocated run's at world size N (k = 0 or 1, dynamic sampling, LoRA (the sync then moves the adapters alone), partial rollouts and multi-turn environments (the episodes run on the generators, each against its own instance of the environment) too). Refused with it: tail overlap."""
    generator_kv_memory_fraction: float = 0.85
    """A generator rank's KV cache: this fraction of the device memory its model leaves free (it holds no trainer, so the card is the engine's; engine.kv_memory_fraction sizes a colocated rank's cache, which shares its card with training). engine.num_kv_blocks, when set, sizes both. A cache too small for the batch makes the engine preempt and recompute; the size never changes a token's bits, but where a partial rollout's cut falls depends on the schedule, so set engine.num_kv_blocks where a disaggregated partial-rollouts run must equal a colocated one on a GPU."""

    def validate(self) -> None:
        _check_at_least(self.generator_ranks, 0, "distributed.generator_ranks")
        if not (0 < self.generator_kv_memory_fraction <= 1):
            _fail(
                "distributed.generator_kv_memory_fraction",
                f"must be in (0, 1], got {self.generator_kv_memory_fraction!r}",
            )
