"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
eq. 13): a completion that runs into the last `buffer_tokens` tokens before the length limit is penalised in
proportion to how far it ran in, so that a cut-off answer is not scored as if it were a wrong one of normal length
(the reward noise the paper attributes to truncation).

    R_length(y) = 0                                          |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache        L_max - L_cache < |y| <= L_max
                = -1                                         L_max < |y|

scaled by a penalty factor (verl's overlong_buffer.penalty_factor) and added to the task's reward. Here L_max is
sampling.max_tokens and L_cache reward.overlong_buffer_tokens; |y| counts completion tokens. A completion of exactly
L_max - L_cache tokens is not penalised; one of L_max tokens (cut at the limit) gets -penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

PENALTY_KEY = "overlong_penalty"  # its per-function name: logged as reward/overlong_penalty/mean|std


def overlong_penalties(
    lengths: Sequence[int], max_tokens: int, buffer_tokens: int, penalty: float = 1.0
) -> list[float]:
    """The soft overlong penalty of each completion (<= 0), in Python floats (the rewards' own type).
    lengths: completion token counts; max_tokens: L_max; buffer_tokens: L_cache, in [1, max_tokens)."""
    if not 0 < buffer_tokens < max_tokens:
        raise ValueError(
            f"overlong buffer_tokens must be in [1, max_tokens = {max_tokens}), got {buffer_tokens}"
        )
    start = max_tokens - buffer_tokens  # the last length with no penalty
    out = []
    for n in lengths:
        over = min(max(n - start, 0), buffer_tokens)  # beyond max_tokens: the full penalty (the paper's -1)
        out.append(-penalty * over / buffer_tokens if over else 0.0)
    return out


class _Rewards(Protocol):
    rewards: list[float]
    per_function: dict[str, list[float]]


def add_overlong_penalty(
    result: _Rewards, lengths: Sequence[int], max_tokens: int, buffer_tokens: int, penalty: float
) -> None:
    """Add the penalty to `result.rewards` in place and record it as the per-function reward "overlong_penalty"
    (so its mean is logged next to the task's functions). The correctness verdict (`correct`) is left alone: a
    right answer that ran long is still right, and accuracy counts it."""
    if len(lengths) != len(result.rewards):
        raise ValueError(f"{len(lengths)} completion lengths for {len(result.rewards)} rewards")
    pen = overlong_penalties(lengths, max_tokens, buffer_tokens, penalty)
    result.rewards = [r + p for r, p in zip(result.rewards, pen)]
    result.per_function[PENALTY_KEY] = pen


def overlong_metrics(per_function: dict[str, list[float]]) -> dict[str, float]:
    """`overlong/penalized_samples`: the step's samples the soft penalty touched (none logged when it is off)."""
    pen = per_function.get(PENALTY_KEY)
    if pen is None:
        return {}
    return {"overlong/penalized_samples": float(sum(p < 0 for p in pen))}
