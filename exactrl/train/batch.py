"""What the policy trainer takes and builds around a step: a `Rollout` (one sampled sequence), the step's padded
tensors (`StepBatch`), a step fed as its rollouts arrive (`Accumulation`), a queued minibatch, and the metric
accumulator; the trainer's step itself is exactrl/train/trainer.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from exactrl.distributed.env import DistContext
from exactrl.train.router import router_metrics


@dataclass
class Rollout:
    """One sampled sequence. rollout_logprobs: [len(completion_ids)] fp32, recorded by the engine."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: torch.Tensor
    reward: float = 0.0
    truncated: bool = False
    advantage: float = 0.0  # sequence-level advantage (GRPO, RLOO, GSPO); PPO computes token-level ones
    request_id: int | None = None  # the engine request (and sample) that drew it: named when a check fails
    sample_index: int | None = None
    # Multi-turn episodes: which completion tokens the model sampled (True) and which an environment wrote
    # (False: no rollout logprob, 0.0 there, never in the loss); None = every token is the model's.
    loss_mask: list[bool] | None = None


def _pad(flat: torch.Tensor, seq_idx: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Completion rows (in order within each sequence) -> [B, max_len] padded with zeros."""
    B, L = len(lengths), max(lengths)
    out = flat.new_zeros(B, L)
    starts = torch.zeros(B, dtype=torch.long, device=flat.device)
    counts = torch.tensor(lengths, device=flat.device)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    pos = torch.arange(flat.shape[0], device=flat.device) - starts[seq_idx]
    return out.index_put((seq_idx, pos), flat)


def _mask(lengths: list[int], device) -> torch.Tensor:
    L = max(lengths)
    return torch.arange(L, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _rows(t: torch.Tensor, ids: list[int], batch: int, cols: int) -> torch.Tensor:
    """Rows `ids` of a step-level [N, L] tensor as a zero-padded [batch, cols] one (a bucket's loss matrix)."""
    out = torch.zeros(batch, cols, dtype=t.dtype)
    w = min(cols, t.shape[1])
    out[: len(ids), :w] = t[ids, :w]
    return out


def _padded_list(vals: list[torch.Tensor], L: int, device) -> torch.Tensor:
    out = torch.zeros(len(vals), L, dtype=torch.float32, device=device)
    for i, v in enumerate(vals):
        out[i, : v.numel()] = v.to(device)
    return out


@dataclass
class _Acc:
    """Folds per-microbatch metrics into step metrics: sums add, fractions weigh by tokens, extrema fold."""

    sums: dict[str, float] = field(default_factory=dict)
    weighted: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    num_minibatches: int = 0
    num_microbatches: int = 0  # the step's packed microbatches (each rank runs as many: the largest count)
    # Mixture of experts: summed `router_stats` [L, E + 2] of every training forward, and their layers.
    router: torch.Tensor | None = None
    router_layers: list[int] | None = None

    # Losses computed with the minibatch's global divisor: each microbatch holds its share of the minibatch's
    # loss, so shares add up within a minibatch and the step reports the mean over minibatches.
    SHARE_KEYS = ("pg_loss", "vf_loss", "moe/aux_loss", "moe/z_loss")

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            if k in self.SHARE_KEYS:
                self.shares[k] = self.shares.get(k, 0.0) + v
            elif k.endswith("/min"):
                self.mins[k] = min(self.mins.get(k, math.inf), v)
            elif k.endswith("/max"):
                self.maxs[k] = max(self.maxs.get(k, -math.inf), v)
            elif k.endswith(("/sum", "/sum_sq")) or k in ("num_tokens", "num_seqs"):
                self.sums[k] = self.sums.get(k, 0.0) + v
            else:
                self.weighted[k] = self.weighted.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def reduce(self, dist: DistContext) -> None:
        """Fold every rank's accumulators into global ones (the same on every rank)."""
        if not dist.distributed:
            return
        if self.router is not None:  # every rank runs as many forwards of the same model: one shape
            summed = dist.all_reduce(self.router.flatten().tolist())
            self.router = torch.tensor(summed, dtype=torch.float64).view(self.router.shape)
        merged = dist.all_gather_object(
            (self.sums, self.weighted, self.weights, self.mins, self.maxs, self.shares)
        )
        self.sums, self.weighted, self.weights, self.mins, self.maxs, self.shares = {}, {}, {}, {}, {}, {}
        for sums, weighted, weights, mins, maxs, shares in merged:
            for mine, theirs in ((self.sums, sums), (self.weighted, weighted), (self.weights, weights)):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0.0) + v
            for k, v in shares.items():
                self.shares[k] = self.shares.get(k, 0.0) + v
            for k, v in mins.items():
                self.mins[k] = min(self.mins.get(k, math.inf), v)
            for k, v in maxs.items():
                self.maxs[k] = max(self.maxs.get(k, -math.inf), v)

    def result(self) -> dict[str, float]:
        out = dict(self.sums)
        out.update(self.mins)
        out.update(self.maxs)
        out.update({k: v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.weighted.items()})
        out.update({k: v / max(1, self.num_minibatches) for k, v in self.shares.items()})
        if self.num_microbatches:
            out["perf/train_microbatches"] = float(self.num_microbatches)
        if self.router is not None:
            out.update(router_metrics(self.router, self.router_layers))
        return out


@dataclass
class StepBatch:
    """The step-level tensors of one RL update, [N, L] padded over the N rollouts' completions (CPU)."""

    lengths: list[int]  # completion lengths
    full_mask: torch.Tensor  # [N, L] bool, the loss mask; rollout correction may clear tokens (MIS)
    token_mask: torch.Tensor  # [N, L] bool, the model's sampled tokens (what the exactness check compares)
    rollout_lp: torch.Tensor  # [N, L] fp32, recorded by the engine
    seqs: list[list[int]]  # prompt + completion token ids
    plens: list[int]  # prompt lengths
    norm_constant: float  # Dr.GRPO's constant
    old_lp: torch.Tensor | None = None  # [N, L] fp32; == rollout_lp in exact mode
    ref_lp: torch.Tensor | None = None  # [N, L] fp32, the reference policy's (KL)
    use_loss_kl: bool = False  # KL enters the loss (not the reward)
    weights: torch.Tensor | None = None  # [N, L] importance-sampling weights (rollout correction)
    advantages: torch.Tensor | None = None  # [N, L]
    old_values: torch.Tensor | None = None  # [N, L] critic values before the update (PPO)
    returns: torch.Tensor | None = None  # [N, L] GAE returns (PPO)
    metrics: dict[str, float] = field(default_factory=dict)
    trainer_lp: torch.Tensor | None = None  # [N, L] the checked trainer logprobs (exact mode), when kept
    mismatched: bool = False  # a checked token differs (on any rank)
    # Off-policy, one update: decoupled PPO's cap, its weights computed inside the training forward.
    proximal_cap: float | None = None

    @property
    def L(self) -> int:
        return max(self.lengths)


@dataclass
class Accumulation:
    """A step fed as its rollouts arrive (`PolicyTrainer.begin_accumulation`): the prepared tensors of each piece,
    the rollouts in the order they were fed, and per queued microbatch (rollout ids in that order, loss mask, metric
    vector, the trainer's logprobs for the guard)."""

    batches: list[StepBatch] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)
    done: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list
    )
    acc: _Acc = field(default_factory=_Acc)


def _concat_batches(batches: list[StepBatch]) -> StepBatch:
    """The pieces of an accumulated step as one StepBatch (rows in feed order, padded to the longest completion):
    what `read_results` and the guard's report read."""

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        L = max(t.shape[1] for t in ts)
        out = ts[0].new_zeros(sum(t.shape[0] for t in ts), L)
        row = 0
        for t in ts:
            out[row : row + t.shape[0], : t.shape[1]] = t
            row += t.shape[0]
        return out

    first = batches[0]
    return StepBatch(
        lengths=[n for b in batches for n in b.lengths],
        full_mask=cat([b.full_mask for b in batches]),
        token_mask=cat([b.token_mask for b in batches]),
        rollout_lp=cat([b.rollout_lp for b in batches]),
        seqs=[q for b in batches for q in b.seqs],
        plens=[p for b in batches for p in b.plens],
        norm_constant=first.norm_constant,
        old_lp=cat([b.rollout_lp for b in batches]),
        use_loss_kl=first.use_loss_kl,
        # The pieces' counts (one process: the accumulated step is refused under torchrun), e.g. overlong filtering's.
        metrics={
            k: sum(b.metrics[k] for b in batches)
            for k in ("overlong/filtered_samples",)
            if k in first.metrics
        },
    )


@dataclass
class _QueuedMinibatch:
    """A minibatch whose update is queued: per microbatch (rollout ids, loss mask, metric vector, trainer
    logprobs when checked), the metric vectors stacked, the device-side gradient norms."""

    done: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]]
    vecs: torch.Tensor
    norm: torch.Tensor | None
    critic_norm: torch.Tensor | None
    check_mismatch: bool
    divisor: int
    gated: bool = False  # a mismatch skipped its update


def _pad_to(x: torch.Tensor, L: int) -> torch.Tensor:
    if x.shape[1] == L:
        return x
    return torch.nn.functional.pad(x, (0, L - x.shape[1]))
