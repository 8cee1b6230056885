"""One-step-off RL under torchrun (algorithm.max_off_policy_steps = 1 at world size N): the pieces that differ
from one process.

Layout: colocated, as the synchronous distributed run. Every rank holds the trainer's FSDP2 shards and a full
engine replica in the model dtype, which `Parallelism.sync_weights` all-gathers from the shards after each step.
That replica *is* the behaviour policy (`ReplicaBehaviour`): its version is the last sync, and no third copy of
the weights is made. During the update of step t (main thread, FSDP2 collectives), each rank's generation worker
samples its share of batch t + 1 from its replica; the replica is refreshed (the sync, a collective) only after
the worker has joined.

Collectives stay on the main thread. Two threads issuing collectives on one process group interleave in an order
that differs between ranks (rank 0's worker may reach its all-gather while rank 1's trainer is in a reduce-scatter):
the ranks then hang, or pair up the wrong tensors. A second process group for the worker would keep the orders
apart on gloo, but NCCL does not promise progress for two communicators whose kernels run concurrently on one GPU
(each may wait for SMs the other holds), and every rank would pay for a second communicator. So the worker's job
(`OneStepOffDriver.sample`, exactrl/train/drivers/offpolicy.py) issues none: prompts (every rank reads the same stream and takes its share), generation,
this rank's rewards (reward functions run in processes of their own, no collective) and the guard's forward on
the replica. What needs the other ranks runs on the main thread once the worker has joined (`OneStepOffDriver.gather`):
the worker's outcome (`agreed`: a failure on one rank stops every rank with its error), the step's advantage
statistics and reward failures (`RLRun.step_scores`), ReMax's baseline, the guard's verdict (`agree_guard`), the
staleness metrics (`step_staleness`). They are a few small all-gathers per step.

The guard's forward runs on the replica, a plain module in the model dtype, through the training forward's code
(`BehaviourPolicy.score`: packed microbatches, `response_logprobs`). The trainer's FSDP2 forward computes with the
all-gathered shards cast to the model dtype, the very bits the replica holds after a sync (tests/distributed check
it tensor by tensor), through the same code: the synchronous distributed guard relies on the same fact, and the
first off-policy step shows it again (its importance weights pi_prox / pi_behav, the FSDP2 forward over the replica's
recorded logprobs, are exactly 1.0).

Checkpoints hold each rank's pending batch in `offpolicy_pending/rank<r>-of-<N>/` (`save_rank_pending`); a resume
at the same world size trains on its own, bitwise the uninterrupted run; at another world size the batch is split
again by prompt groups (`load_any_pending`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from exactrl.distributed.env import DistContext
from exactrl.distributed.parallelize import Parallelism
from exactrl.model.qwen import CausalLM
from exactrl.train.offpolicy import (
    PENDING_FILE,
    BehaviourBatch,
    BehaviourPolicy,
    load_pending,
    save_pending,
    staleness_metrics,
)
from exactrl.train.trainer import MismatchError

T = TypeVar("T")


class ReplicaBehaviour(BehaviourPolicy):
    """The behaviour policy under torchrun: this rank's engine replica itself (no copy; `BehaviourPolicy` would
    make one). `refresh` is the weight sync from the shards, so it is a collective: every rank calls it at the same
    point, after its generation worker has joined."""

    def __init__(self, replica: CausalLM, parallel: Parallelism, version: int = 0) -> None:
        # Not BehaviourPolicy.__init__, which deep-copies the policy: the replica already is a copy in the model
        # dtype, refreshed in place (the engine's CUDA graphs keep their addresses).
        self.model = replica
        self.version = version
        self.parallel = parallel
        self.last_sync: dict[str, float] = {}  # the last refresh's weight-sync metrics

    def refresh(self, version: int, *, full: bool = False) -> float:
        """All-gather the trainer's shards into the replica (`Parallelism.sync_weights`); returns the seconds."""
        self.last_sync = self.parallel.sync_weights(full=full)
        self.version = version
        return self.last_sync.get("time/weight_sync_s", 0.0)


@dataclass
class RankSample:
    """One rank's share of the next batch as the generation worker leaves it: sampled, rewarded on this rank and
    checked by the guard on this rank's tokens; nothing gathered over the ranks yet."""

    scores: Any  # the loop's RankScores
    greedy: list[float] | None  # ReMax: this rank's greedy rewards, one per prompt
    version: int  # the behaviour version that sampled it
    generate_s: float
    guard: dict[str, float]  # mismatch/* over this rank's tokens
    mismatch: MismatchError | None  # this rank's guard verdict
    guard_s: float


class WorkerFailed(RuntimeError):
    """A rank's generation (worker thread or the main thread's first batch) failed; raised on every rank."""


def agreed(ctx: DistContext, what: str, job: Callable[[], T]) -> T:
    """`job()`, with its failure on any rank raised on every rank: after the job every rank says whether it failed
    (one all-gather, the main thread's), so a rank whose generation failed stops the others with its error instead
    of leaving them waiting in their next collective until the timeout. Without a process group: `job()`."""
    if not ctx.distributed:
        return job()
    out: Any = None
    failure: Exception | None = None
    try:
        out = job()
    except Exception as err:  # every rank must reach the exchange below, this one too
        failure = err
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    verdicts = ctx.all_gather_object(said)
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        r, first = failed[0]
        others = f" (and on ranks {[x for x, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise WorkerFailed(f"{what} failed on rank {r}{others}: {first}") from failure
    return out


# How each guard metric of `mismatch_metrics` combines over the ranks: counts add, maxima take the max, means are
# weighted by the ranks' token counts (an exact run has 0 and 1.0 there, which stay exact).
_SUM, _MAX, _MEAN = ("sum", "max", "mean")
_MERGE = {
    "mismatch/num_tokens": _SUM,
    "mismatch/num_mismatched_tokens": _SUM,
    "mismatch/logprob_abs_diff_max": _MAX,
    "mismatch/logprob_abs_diff_mean": _MEAN,
    "mismatch/token_mult_prob_error": _MEAN,
    "mismatch/kl_k3": _MEAN,
}


def merge_mismatch_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The guard's metrics over every rank's tokens from each rank's (`mismatch_metrics` per rank)."""
    keys = set().union(*parts) if parts else set()
    unknown = sorted(keys - set(_MERGE))
    if unknown:
        raise ValueError(
            f"no rule to combine the guard metrics {unknown} over the ranks (offpolicy_dist._MERGE)"
        )
    n = [p.get("mismatch/num_tokens", 0.0) for p in parts]
    total = sum(n)
    out: dict[str, float] = {}
    for key in sorted(keys):
        vals = [p[key] for p in parts]
        rule = _MERGE[key]
        if rule == _SUM:
            out[key] = float(sum(vals))
        elif rule == _MAX:
            out[key] = float(max(vals))
        elif total > 0:
            out[key] = float(sum(w * v for w, v in zip(n, vals)) / total)
        else:  # no token anywhere: every rank reported the no-token value
            out[key] = float(vals[0])
    return out


def agree_guard(
    ctx: DistContext, metrics: dict[str, float], mismatch: MismatchError | None
) -> tuple[dict[str, float], MismatchError | None]:
    """The guard's verdict over every rank (a collective): the metrics over every rank's tokens, and a
    MismatchError on *every* rank when any rank found a differing token, naming the first such rank's first token,
    so that all ranks refuse the batch before the update (one rank training while another aborts would hang the
    first in its next FSDP collective). Each rank's error keeps its own offending sequences (the replay report
    gathers them)."""
    if not ctx.distributed:
        return metrics, mismatch
    parts = ctx.all_gather_object((metrics, None if mismatch is None else str(mismatch)))
    merged = merge_mismatch_metrics([p[0] for p in parts])
    bad = [(r, msg) for r, (_, msg) in enumerate(parts) if msg is not None]
    if not bad:
        return merged, None
    r, msg = bad[0]
    ranks = ", ".join(str(x) for x, _ in bad)
    head = f"on rank {r} (ranks with a differing token: {ranks}): {msg}"
    return merged, MismatchError(head, mismatch.sequences if mismatch is not None else [])


def step_staleness(
    ctx: DistContext,
    batch: BehaviourBatch,
    policy_version: int,
    masks: list[torch.Tensor],
    mixed: bool = False,
) -> dict[str, float]:
    """`staleness_metrics` over every rank's tokens (a collective under torchrun)."""
    if not ctx.distributed:
        return staleness_metrics(batch, policy_version, masks, mixed=mixed)
    parts = ctx.all_gather_object((batch.versions, masks))
    everyone = dataclasses.replace(batch, versions=[v for p in parts for v in p[0]])
    return staleness_metrics(everyone, policy_version, [m for p in parts for m in p[1]], mixed=mixed)


# -- the pending batch in a sharded checkpoint ------------------------------------------------------------------

RANKS_DIR = "offpolicy_pending"
_RANK_NAME = re.compile(r"rank(\d+)-of-(\d+)")


def save_rank_pending(directory: Path, batch: BehaviourBatch, rank: int, world_size: int) -> None:
    """Every rank writes its share of the batch sampled ahead into the checkpoint being assembled:
    `offpolicy_pending/rank<r>-of-<N>/offpolicy_pending.json` (the one-process file format). A batch the guard
    refused is not written: the refusal is agreed, so no rank writes one."""
    if batch.mismatch is not None:
        return
    d = directory / RANKS_DIR / f"rank{rank}-of-{world_size}"
    d.mkdir(parents=True, exist_ok=True)
    save_pending(d, batch)


def _split_by_groups(batches: list[BehaviourBatch], ctx: DistContext) -> BehaviourBatch | None:
    """Every rank's share concatenated in rank order (the step's order), then split over this run's ranks by whole
    prompt groups (a group stays on one rank); None when there are fewer groups than ranks. Rewards, advantages
    and the step's statistics are the whole step's on every rank already."""
    first = batches[0]
    rollouts = [ro for b in batches for ro in b.sr.rollouts]
    completions = [c for b in batches for c in b.sr.completions]
    answers = [a for b in batches for a in b.sr.answers]
    versions = [v for b in batches for v in b.versions]
    bounds = [0] + [
        i for i in range(1, len(rollouts)) if rollouts[i].request_id != rollouts[i - 1].request_id
    ]
    bounds.append(len(rollouts))
    groups = len(bounds) - 1
    if groups < ctx.world_size:
        return None
    mine = ctx.shard(groups)
    lo, hi = bounds[mine.start], bounds[mine.stop]
    sr = dataclasses.replace(
        first.sr, rollouts=rollouts[lo:hi], completions=completions[lo:hi], answers=answers[lo:hi]
    )
    return dataclasses.replace(first, sr=sr, versions=versions[lo:hi])


def load_any_pending(
    directory: Path, ctx: DistContext, step_rollouts_cls: type
) -> tuple[BehaviourBatch | None, str | None]:
    """The batch a checkpoint holds for this rank, and a note when it had to be split again: the one-process file
    (`offpolicy.load_pending`), or the per-rank files of a torchrun run. Those are this rank's own at the same world
    size (bitwise the uninterrupted run); at another world size every rank reads them all and takes its share by
    prompt groups (the same batch and advantages, trained on other ranks: not bitwise, as any change of world size)."""
    root = directory / RANKS_DIR
    if not root.is_dir():
        return load_pending(directory, step_rollouts_cls), None
    parts: dict[int, Path] = {}
    worlds = set()
    for d in root.iterdir():
        m = _RANK_NAME.fullmatch(d.name)
        if m is None or not (d / PENDING_FILE).is_file():
            raise ValueError(f"{d}: not a pending batch of one rank (rank<r>-of-<N>/{PENDING_FILE})")
        parts[int(m.group(1))] = d
        worlds.add(int(m.group(2)))
    if len(worlds) != 1 or sorted(parts) != list(range(next(iter(worlds)))):
        raise ValueError(
            f"{root}: the ranks' pending batches are incomplete or of several world sizes ({sorted(p.name for p in parts.values())})"
        )
    saved_ws = worlds.pop()
    if saved_ws == ctx.world_size:
        return load_pending(parts[ctx.rank], step_rollouts_cls), None
    batches = [load_pending(parts[r], step_rollouts_cls) for r in range(saved_ws)]
    split = _split_by_groups([b for b in batches if b is not None], ctx)
    if split is None:
        return None, f"its pending batch has fewer prompt groups than the {ctx.world_size} ranks"
    return (
        split,
        f"its pending batch, sampled on {saved_ws} ranks, is split over {ctx.world_size} by prompt groups",
    )
