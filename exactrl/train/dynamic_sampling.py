"""DAPO's dynamic sampling (algorithm.dynamic_sampling): a group whose samples all score the same carries no gradient
under a group baseline (GRPO, Dr.GRPO, RLOO, ...: every advantage is zero), yet it costs a training forward and
dilutes a token-mean loss. Such groups are dropped, and more prompts are drawn and sampled, round after round, until
the step holds `prompts_per_step` groups with signal or the cap on extra rounds is reached (then the step trains on
what there is, and `dynamic_sampling/groups_missing` says how many it lacked).

What is equal: "reward" compares the rewards the advantages see (the overlong penalty included), "accuracy" the
correctness verdicts (the reward.accuracy function's score > 0.5; a multi-turn episode's: its environment reward
> 0.5). A group with one sample never has signal.

The decision is global: every rank gathers every rank's verdicts (in rank order, which is draw order: each round's
prompts are sharded in contiguous blocks) and keeps the same groups, the first ones with signal in draw order. The
kept groups are then dealt out again in contiguous blocks, so every rank trains on at least one group and the step
trains the same groups, in the same order, at every world size. Every kept token goes through the trainer's guard as
any other; a dropped group never reaches the trainer (nor, one step off, a pending batch).

Data: each round draws its prompts from the run's one stream, so the task's position in a checkpoint has advanced by
every prompt drawn (kept or not), and a resume continues where the uninterrupted run would. Sampling noise: round r
of step s keys its requests `request_id_base(s, r, P) + i`; round 0 is the step's usual base (a run whose groups all
have signal samples what a run without dynamic sampling does) and later rounds live above 2**40, where no round 0 and
no other round reaches.

The loop enters through `DynamicSampler.collect`, handed three callables (draw prompts, sample and score a round,
print) and the run's `DistContext`; nothing here knows the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from exactrl.distributed.env import DistContext

ROUND_ID_SHIFT = (
    40  # round r >= 1 keys its requests from r << 40: above every round-0 id of a run below 2**40 prompts
)


def request_id_base(step: int, round_: int, prompts_per_step: int) -> int:
    """The first request id of round `round_` of step `step` (the prompt's index in the round is added)."""
    return (round_ << ROUND_ID_SHIFT) + step * prompts_per_step


def has_signal(values: Sequence[float]) -> bool:
    """Whether a group's values are not all equal (exact comparison: equal rewards give a zero group baseline
    advantage, whatever they are)."""
    return any(v != values[0] for v in values[1:])


def group_values(
    rewards: Sequence[float], correct: Sequence[bool] | None, metric: str, group_size: int
) -> list[list[float]]:
    """The values each group is judged by: its rewards ("reward") or its correctness verdicts ("accuracy")."""
    if metric == "accuracy":
        if correct is None:
            raise ValueError(
                'algorithm.dynamic_sampling = "accuracy": the rewards have no correctness function (reward.accuracy '
                'found none among reward.functions); name one in reward.accuracy, or filter on "reward"'
            )
        vals: Sequence[float] = [float(c) for c in correct]
    elif metric == "reward":
        vals = rewards
    else:
        raise ValueError(f"dynamic sampling metric must be 'reward' or 'accuracy', got {metric!r}")
    if len(vals) % group_size:
        raise ValueError(f"{len(vals)} samples do not make groups of {group_size}")
    return [list(vals[i : i + group_size]) for i in range(0, len(vals), group_size)]


def next_draw(missing: int, drawn: int, with_signal: int, prompts_per_step: int, world_size: int) -> int:
    """Prompts the next round draws: enough to fill the `missing` groups at the rate of signal seen so far in the
    step (`with_signal` of `drawn`), at least one per rank and `missing`, at most prompts_per_step (a whole step's
    draw, as verl's generation batch; it also keeps a round's request ids within the step's range)."""
    if with_signal == 0:
        want = prompts_per_step
    else:
        want = math.ceil(missing * drawn / with_signal)
    return max(missing, world_size, min(want, prompts_per_step))


class Share(Protocol):
    """One rank's sampled and scored prompts of a round (the loop's RankScores): rollouts in groups of group_size,
    `rewards` a RewardResult aligned with them."""

    rollouts: list[Any]
    rewards: Any
    completions: list[str]
    answers: list[str]
    refused: int


Draw = tuple[
    list[Any], list[list[int]], list[int]
]  # this rank's examples, prompt token ids, indices in the round
SampleRound = Callable[[int, Draw], Share]  # (round, draw) -> this rank's share, sampled and scored


@dataclass
class _Group:
    """One group of a rank's share, with its place in the step's draw order (round, rank, index on the rank)."""

    order: tuple[int, int, int]
    rollouts: list[Any]
    rewards: list[float]
    per_function: dict[str, list[float]]
    correct: list[bool] | None
    completions: list[str]
    answers: list[str]


@dataclass
class _Tally:
    """What the step has seen so far, the same on every rank (built from gathered verdicts)."""

    kept: list[tuple[int, int, int]] = field(default_factory=list)  # groups with signal kept, in draw order
    spare: list[tuple[int, int, int]] = field(default_factory=list)  # groups without signal, in draw order
    with_signal: int = 0  # groups with signal seen, kept or surplus
    dropped: int = 0
    drawn: int = 0


class DynamicSampler:
    """The step's groups, sampled round by round until `target` of them have signal (module docstring)."""

    def __init__(
        self,
        metric: str,
        group_size: int,
        prompts_per_step: int,
        max_extra_rounds: int,
        dist: DistContext,
        out: Callable[[str], Any] = print,
    ) -> None:
        if metric not in ("reward", "accuracy"):
            raise ValueError(f"dynamic sampling metric must be 'reward' or 'accuracy', got {metric!r}")
        self.metric, self.group_size = metric, group_size
        self.target, self.max_extra_rounds = prompts_per_step, max_extra_rounds
        self.dist, self.out = dist, out

    def collect(
        self, step: int, first: Draw, draw: Callable[[int], Draw], sample: SampleRound
    ) -> tuple[Share, dict[str, float]]:
        """Round 0 samples `first` (the step's usual prompts); each extra round draws `draw(count)` more. Returns
        this rank's share of the kept groups (the first round's share with its groups replaced) and the step's
        metrics: dynamic_sampling/{prompts_drawn, extra_rounds, groups_dropped, groups_kept, groups_surplus,
        groups_padded, groups_missing}."""
        tally = _Tally()
        mine: dict[tuple[int, int, int], _Group] = {}  # this rank's groups that may still be trained on
        errors: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        first_error: dict[str, str] = {}
        refused = 0
        base: Share | None = None
        round_, d, count = 0, first, self.target  # the loop's prompts() draws prompts_per_step for round 0
        while True:
            share = sample(round_, d)
            base = base or share
            refused += share.refused
            res = share.rewards
            for acc, part in ((errors, res.num_errors), (timeouts, res.num_timeouts)):
                for k, n in part.items():
                    acc[k] = acc.get(k, 0) + n
            for k, v in res.first_error.items():
                first_error.setdefault(k, v)
            groups = self._groups(round_, share)
            verdicts = [
                has_signal(v) for v in group_values(res.rewards, res.correct, self.metric, self.group_size)
            ]
            tally.drawn += (
                count  # every rank read the same `count` prompts from the stream, each kept its block
            )
            for rank, flags in enumerate(self.dist.all_gather_object(verdicts)):
                for i, signal in enumerate(flags):
                    key = (round_, rank, i)
                    if signal:
                        tally.with_signal += 1
                        if len(tally.kept) < self.target:
                            tally.kept.append(key)
                    else:
                        tally.dropped += 1
                        tally.spare.append(key)
            # Hold on to this rank's kept groups, and to the few spare ones a short step may need (one per rank).
            needed = set(tally.kept) | set(tally.spare[: self.dist.world_size])
            mine.update((g.order, g) for g in groups)
            mine = {k: g for k, g in mine.items() if k in needed}
            missing = self.target - len(tally.kept)
            if missing == 0 or round_ == self.max_extra_rounds:
                break
            round_ += 1
            count = next_draw(missing, tally.drawn, tally.with_signal, self.target, self.dist.world_size)
            d = draw(count)
        assert base is not None
        # A short step still trains every rank on a group: without enough groups with signal, groups without it fill
        # the places up to one per rank (their advantages are zero; they keep the ranks' collectives in step).
        padded = tally.spare[: max(0, self.dist.world_size - len(tally.kept))]
        order = sorted(tally.kept + padded)
        kept = self._deal(order, mine)
        rewards = dataclasses.replace(
            base.rewards,
            rewards=[r for g in kept for r in g.rewards],
            per_function={k: [v for g in kept for v in g.per_function[k]] for k in base.rewards.per_function},
            num_errors=errors,
            num_timeouts=timeouts,
            first_error=first_error,
            correct=None if base.rewards.correct is None else [c for g in kept for c in g.correct or []],
        )
        # A Share is the loop's RankScores, a dataclass; a Protocol cannot say so.
        result = dataclasses.replace(  # type: ignore[type-var]
            base,
            rollouts=[ro for g in kept for ro in g.rollouts],
            rewards=rewards,
            completions=[c for g in kept for c in g.completions],
            answers=[a for g in kept for a in g.answers],
            refused=refused,
        )
        missing = self.target - len(tally.kept)
        if missing:
            self.out(
                f"step {step + 1}: dynamic sampling found {len(tally.kept)} of {self.target} groups with signal "
                f"after {round_} extra rounds (algorithm.dynamic_sampling_max_rounds = {self.max_extra_rounds}); "
                f"training on those"
                + (f" and {len(padded)} without signal (one group per rank)" if padded else "")
            )
        metrics = {
            "dynamic_sampling/prompts_drawn": float(tally.drawn),
            "dynamic_sampling/extra_rounds": float(round_),
            "dynamic_sampling/groups_dropped": float(tally.dropped),
            "dynamic_sampling/groups_kept": float(len(tally.kept)),
            "dynamic_sampling/groups_surplus": float(tally.with_signal - len(tally.kept)),
            "dynamic_sampling/groups_padded": float(len(padded)),
            "dynamic_sampling/groups_missing": float(missing),
        }
        return result, metrics

    def _groups(self, round_: int, share: Share) -> list[_Group]:
        """Cut a rank's share into its groups (a refused prompt left no group: the rest are whole)."""
        g, res, rank = self.group_size, share.rewards, self.dist.rank
        n = len(share.rollouts)
        if n % g or len(res.rewards) != n:
            raise ValueError(f"{n} rollouts and {len(res.rewards)} rewards do not make groups of {g}")
        return [
            _Group(
                order=(round_, rank, i // g),
                rollouts=share.rollouts[i : i + g],
                rewards=list(res.rewards[i : i + g]),
                per_function={k: list(v[i : i + g]) for k, v in res.per_function.items()},
                correct=None if res.correct is None else list(res.correct[i : i + g]),
                completions=share.completions[i : i + g],
                answers=share.answers[i : i + g],
            )
            for i in range(0, n, g)
        ]

    def _deal(
        self, order: list[tuple[int, int, int]], mine: dict[tuple[int, int, int], _Group]
    ) -> list[_Group]:
        """This rank's contiguous block of the kept groups (in draw order), wherever they were sampled. On one
        process the groups are its own; under torchrun every rank's kept groups are gathered first."""
        if not self.dist.distributed:
            return [mine[k] for k in order]
        held = {
            g.order: g
            for part in self.dist.all_gather_object([mine[k] for k in order if k in mine])
            for g in part
        }
        return [held[order[i]] for i in self.dist.shard(len(order))]
