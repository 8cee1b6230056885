"""One sample being generated: its tokens, its place in the paged KV cache, and its status.

A `Sequence` is plain bookkeeping (no tensors). The scheduler and the block manager move it through its life:

    WAITING --(admitted, blocks allocated)--> RUNNING --(stop / length / error)--> FINISHED
       ^                                         |
       +------(preempted: blocks freed, KV to be recomputed)

Parallel sampling (the `n` samples of one prompt, e.g. a GRPO group) starts as ONE sequence with
`num_samples = n`. When its prompt is fully prefilled, the scheduler forks it into `n` sequences that share the
prompt's KV blocks (see scheduler.py); each child then has `num_samples = 1` and its own `sample_index`.

Multi-turn (`multi_turn=True`, an episode with an environment): the end of a model turn (stop token, stop string,
max_tokens of the turn) PAUSES the sequence instead of finishing it. A paused sequence keeps its KV blocks (unless
the scheduler needs them: it is then preempted like a running one, and recomputes on resume) while the
environment thinks; `Scheduler.resume` appends the observation tokens and the next turn prefills them on top of
the cached conversation; `Scheduler.release` ends the episode:

    RUNNING --(turn ends)--> PAUSED --(resume: observation appended)--> RUNNING ... --(release)--> FINISHED
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# Stands for a sampled token whose value is still on the device (the engine schedules the next step before it
# reads the last one back; see scheduler.py, "Pipelining"). Never a real token id: ids are >= 0.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # multi-turn: the model's turn ended; the environment has not answered yet
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens of one sample, and where their KV lives.

    Identity:
        seq_id: unique per scheduler (forked children get fresh ids from the scheduler).
        request_id: index of the prompt in the generate call (shared by the n samples of a prompt).
        sample_index: 0..n-1, which sample of the prompt this is. Together with request_id, the position and
            the request's seed it fixes the sampling noise, so results never depend on scheduling.
    Tokens:
        token_ids: prompt followed by generated tokens (a stop token, when produced, is kept as the last one).
            The last one may be PENDING_TOKEN between the scheduler's commit() and resolve() of its step.
        num_prompt_tokens: length of the prompt part.
        max_tokens: most generated tokens of the current turn (of the whole completion for a single-turn
            sequence); reaching it ends the turn with reason "length".
        max_tokens_per_sample: None (every sample of a group gets max_tokens), or one limit per sample of a
            group parent (entry j for sample j, entry 0 being the parent's own max_tokens), handed to the forks:
            lets a caller give each sample its own length limit (e.g. a seeded length distribution in
            `exactrl bench rl`, where a random-init model never stops by itself).
        turn_start: index in token_ids where the current model turn began (num_prompt_tokens for the first).
        multi_turn: the end of a turn pauses the sequence (keeping its KV) instead of finishing it.
        stop_token_ids: generated tokens that finish the sequence with reason "stop".
        num_samples: how many samples the first sampled position produces (n for a not-yet-forked group
            parent, else 1).
        rollout_logprobs: one log-probability per generated token, appended by the engine.
    KV cache (owned by the block manager; read-only for everyone else):
        num_computed_tokens: tokens 0 .. num_computed_tokens-1 have their KV in the cache.
        block_table: block ids; token p lives in block block_table[p // block_size] at offset p % block_size.
        block_hashes: memo of the prefix-cache hash of each full block of token_ids (a pure function of the
            tokens, so it survives preemption and is inherited by forks).
        num_cached_tokens: tokens whose KV came from the prefix cache at the last admission (statistics).
    Life:
        status, finish_reason ("stop", "length", or "error: ..."), num_preemptions.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: int,
        prompt_token_ids: Iterable[int],
        *,
        max_tokens: int,
        sample_index: int = 0,
        num_samples: int = 1,
        stop_token_ids: Iterable[int] = (),
        multi_turn: bool = False,
        max_tokens_per_sample: Iterable[int] | None = None,
    ) -> None:
        self.seq_id = int(seq_id)
        self.request_id = int(request_id)
        self.sample_index = int(sample_index)
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = int(max_tokens)
        self.num_samples = int(num_samples)
        self.stop_token_ids: tuple[int, ...] = tuple(int(t) for t in stop_token_ids)
        self.turn_start = self.num_prompt_tokens
        self.multi_turn = bool(multi_turn)
        if self.num_prompt_tokens == 0:
            raise ValueError(f"sequence {seq_id}: prompt_token_ids must hold at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"sequence {seq_id}: max_tokens must be >= 1, got {max_tokens}")
        if self.num_samples < 1:
            raise ValueError(f"sequence {seq_id}: num_samples must be >= 1, got {num_samples}")
        if self.request_id < 0 or self.sample_index < 0:
            raise ValueError(f"sequence {seq_id}: request_id and sample_index must be >= 0")
        self.max_tokens_per_sample: tuple[int, ...] | None = None
        if max_tokens_per_sample is not None:
            self.set_max_tokens_per_sample(max_tokens_per_sample)

        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0

        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.rollout_logprobs: list[float] = []
        self.num_preemptions = 0
        # Multi-turn: [start, end) of each observation in token_ids (appended by Scheduler.resume; never
        # sampled, so no rollout logprob).
        self.observation_spans: list[tuple[int, int]] = []

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_turn_tokens(self) -> int:
        """Tokens of the current model turn so far (what max_tokens limits)."""
        return len(self.token_ids) - self.turn_start

    @property
    def turn_token_ids(self) -> list[int]:
        return self.token_ids[self.turn_start :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_paused(self) -> bool:
        return self.status is SequenceStatus.PAUSED

    @property
    def turn_ended(self) -> bool:
        """Finished, or paused at the end of a turn: no more tokens are sampled until a resume."""
        return self.status is SequenceStatus.FINISHED or self.status is SequenceStatus.PAUSED

    # -- mutation (scheduler / engine) -----------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        """Record a sampled token (and, when the engine has it, its rollout log-probability)."""
        if self.is_finished:
            raise ValueError(
                f"sequence {self.seq_id} is finished ({self.finish_reason}); cannot append tokens"
            )
        self.token_ids.append(int(token_id))
        if logprob is not None:
            self.rollout_logprobs.append(float(logprob))

    def append_pending(self) -> None:
        """Append a sampled token whose value is not known yet (PENDING_TOKEN); `resolve_token` sets it."""
        self.append_token(PENDING_TOKEN)

    def resolve_token(self, token_id: int, logprob: float | None = None) -> None:
        """Set the value of the pending last token (also when the sequence has finished since, e.g. by reaching
        max_tokens) and record its rollout log-probability."""
        if not self.token_ids or self.token_ids[-1] != PENDING_TOKEN:
            raise ValueError(f"sequence {self.seq_id} has no pending token to resolve")
        if token_id < 0:
            raise ValueError(f"sequence {self.seq_id}: sampled token id {token_id} is negative")
        self.token_ids[-1] = int(token_id)
        if logprob is not None:
            self.rollout_logprobs.append(float(logprob))

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING_TOKEN

    def set_max_tokens_per_sample(self, limits: Iterable[int]) -> None:
        """One length limit per sample of this (not yet forked) group parent; entry 0 becomes its own."""
        lim = tuple(int(x) for x in limits)
        if len(lim) != self.num_samples or min(lim) < 1:
            raise ValueError(
                f"sequence {self.seq_id}: max_tokens_per_sample must hold {self.num_samples} limits >= 1 (one per "
                f"sample), got {list(lim)}"
            )
        if self.num_completion_tokens:
            raise ValueError(f"sequence {self.seq_id} already generated tokens; its limits are fixed")
        self.max_tokens_per_sample = lim
        self.max_tokens = lim[0]

    def new_sample(self, seq_id: int, sample_index: int) -> Sequence:
        """A sibling that has the same prompt and settings but no generated tokens and no KV blocks yet.

        Used when a group parent is forked; the block manager then gives it the parent's blocks."""
        if self.num_completion_tokens:
            raise ValueError(f"sequence {self.seq_id} already generated tokens; only a prompt can be forked")
        child = Sequence(
            seq_id,
            self.request_id,
            self.token_ids,
            max_tokens=self.max_tokens
            if self.max_tokens_per_sample is None
            else self.max_tokens_per_sample[sample_index],
            sample_index=sample_index,
            num_samples=1,
            stop_token_ids=self.stop_token_ids,
            multi_turn=self.multi_turn,
        )
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id}, sample_index={self.sample_index}, "
            f"tokens={self.num_prompt_tokens}+{self.num_completion_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, status={self.status.value}, finish_reason={self.finish_reason!r})"
        )
