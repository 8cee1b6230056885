"""Multi-turn generation over one KV cache: the engine side of an episode with an environment.

A `TurnSession` is one engine call whose sequences are episodes. It runs the same `_Generation.step()` as
`RolloutEngine.generate` (schedule -> launch -> settle -> commit), but a sequence whose model turn ends (stop
token, stop string, the turn's max_tokens) PAUSES with its KV blocks kept (scheduler.py, "Multi-turn"). The
caller takes the paused sequences (`take_turn_ends`), asks its environment, and either `resume`s them with the
observation's token ids, which the next steps prefill on top of the cached conversation (no recompute of the
prefix), or `release`s them. Every other sequence keeps decoding meanwhile: episodes at different turns share
every step (continuous batching), none waits for a turn round.

The token ids stay the engine's from end to end: a sampled token is recorded once, an observation's ids are
appended as given, nothing is re-tokenized. `Sequence.observation_spans` marks the observation tokens; every
other token after the prompt was sampled and has its rollout logprob, in order, in `Sequence.rollout_logprobs`.
"""

from __future__ import annotations

from exactrl.engine.engine import RequestOutput, RolloutEngine, _Generation
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.sequence import Sequence


class TurnSession:
    """Episodes (n per prompt, forked after the shared prompt prefill) advanced one engine step at a time.

    prompts: token ids; params: sampling of every turn (params.max_tokens = the first turn's token limit,
    params.n = episodes per prompt); max_total_tokens: the most tokens (prompt + turns + observations) an episode
    may hold, capped at the engine's max_model_len. `errors[i]` is set for a prompt the engine refused."""

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: list[list[int]],
        params: SamplingParams,
        max_total_tokens: int,
        request_ids: list[int] | None = None,
    ) -> None:
        params.validate()
        self.engine = engine
        self.max_total_tokens = min(int(max_total_tokens), engine.max_model_len)
        request_ids = engine._check_request_ids(prompts, request_ids)
        outputs = [RequestOutput(rid, list(p)) for rid, p in zip(request_ids, prompts)]
        valid = engine._admissible(prompts, outputs)
        for i in list(valid):
            if len(prompts[i]) + 1 > self.max_total_tokens:
                outputs[i].error = (
                    f"prompt has {len(prompts[i])} tokens; with at least one new token that exceeds the "
                    f"episode's {self.max_total_tokens} tokens"
                )
                valid.remove(i)
        self.errors: list[str | None] = [o.error for o in outputs]
        self.request_ids = request_ids
        self._gen: _Generation | None = None
        if valid:
            self._gen = engine._start(
                prompts, request_ids, valid, params, None, max_total_tokens=self.max_total_tokens
            )
        self._closed = False

    @property
    def num_paused(self) -> int:
        return 0 if self._gen is None else len(self._gen.sched.paused)

    def step(self) -> bool:
        """One engine step; False when nothing is runnable or in flight (paused episodes may still wait)."""
        return self._gen is not None and self._gen.step()

    def take_turn_ends(self) -> list[Sequence]:
        """Sequences whose turn ended since the last call, their tokens resolved: PAUSED ones (finish_reason
        "stop" or "length": the turn's end) wait for resume/release; FINISHED ones were refused by the engine
        ("error: ..."), e.g. a conversation that outgrew the whole KV cache."""
        if self._gen is None:
            return []
        done, self._gen.finished = self._gen.finished, []
        return done

    def resume(self, seq: Sequence, observation: list[int], max_tokens: int) -> None:
        """Append the observation's token ids and let the next turn sample at most max_tokens tokens."""
        assert self._gen is not None
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in observation if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"observation token ids must be ints in [0, {vocab}), got {bad[:5]}")
        room = self.max_total_tokens - seq.num_tokens - len(observation)
        if room < 1:
            raise ValueError(
                f"sequence {seq.seq_id}: {seq.num_tokens} tokens + an observation of {len(observation)} leave no "
                f"room for a turn within the episode's {self.max_total_tokens} tokens"
            )
        self._gen.sched.resume(seq, observation, min(int(max_tokens), room))
        self._gen.text_len.pop(seq.seq_id, None)  # the stop-string search starts over with the new turn

    def release(self, seq: Sequence, reason: str) -> None:
        """End the episode: its KV blocks go back to the cache."""
        assert self._gen is not None
        self._gen.sched.release(seq, reason)

    def cache_stats(self) -> dict[str, int]:
        """What the KV bookkeeping did in this call: preemptions (paused evictions included), blocks shared by
        forks, prefix-cache hits, copy-on-write copies."""
        if self._gen is None:
            return {}
        sched = self._gen.sched
        return {
            "preemptions": sched.num_preemptions,
            "paused_evictions": sched.num_paused_evictions,
            **sched.block_manager.stats,
        }

    def close(self) -> None:
        """Count the call's preemptions in the engine's statistics (once)."""
        if self._gen is not None and not self._closed:
            self.engine.stats["preemptions"] += self._gen.sched.num_preemptions
        self._closed = True
