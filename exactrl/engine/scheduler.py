"""Continuous batching: which sequences run in the next step, with how many new tokens each.

How the engine drives it (one step)::

    batch = scheduler.schedule()                     # None: nothing left (has_unfinished() is False)
    runner.copy_blocks(batch.block_copies)           # copy-on-write, BEFORE the forward pass
    hidden = runner.forward([StepEntry(e.token_ids, e.start, e.block_table) for e in batch.entries])
                                                     # one row per entry: its last new token
    rows = batch.sample_rows()                       # which of those rows to sample, and how often
    tokens, logprobs = <draw rows[k] from hidden[rows[k].entry_index], key = noise_key(seed of request,
                        rows[k].request_id, rows[k].sample_index, rows[k].position)>
    scheduler.postprocess(batch, tokens, logprobs)   # appends tokens, forks groups, finishes sequences
                                                     # (= commit(batch) then resolve(...): see Pipelining)
    done = scheduler.take_finished()                 # also holds sequences rejected by add()/schedule()

**Entries.** `batch.entries[i] = (seq, start, num_new_tokens, num_samples, block_table)`: write the KV of
`seq.token_ids[start : start + num_new_tokens]` at positions start.. (keys 0..start-1 are already in the cache,
`start == seq.num_computed_tokens`), using the block table snapshot of the entry. A decode is num_new_tokens
== 1; a prefill chunk is longer (at most `prefill_chunk_size`); both can be mixed in one step. The total of
num_new_tokens is at most `max_num_batched_tokens`, and a step has at most `max_num_seqs` entries.

**Which rows are sampled.** Only an entry whose chunk ends at the sequence's last token
(`start + num_new_tokens == seq.num_tokens`) has `num_samples > 0`; intermediate prefill chunks have 0 and
need no logits. The token sampled from such a row goes to position `start + num_new_tokens`.

**Parallel sampling (fork).** `add()` takes ONE sequence per prompt with `num_samples = n`. The entry that
finishes its prefill has `num_samples = n`: the engine draws n tokens from that single logits row, sample j
with `sample_index = j` in its noise key (`batch.sample_rows()` lists them). `postprocess` then forks the
sequence: the parent keeps sample 0, children 1..n-1 (new seq ids, placed right after the parent in the running
queue) share all of its KV blocks (`BlockManager.fork`), and each appends its own token.

**Copy-on-write.** After a fork the prompt's last block is usually only partly filled and shared. When a
sibling is scheduled to write into it, the block manager gives it a private copy and the step lists
`(src, dst)` in `batch.block_copies`: copy those whole blocks (every layer, K and V) before the forward pass.
Sources are read before any destination is written (gather then scatter, as `index_select`/`index_copy_`
does); destinations are distinct and belong to sequences of this step.

**Preemption (recompute).** When a running sequence cannot get the blocks it needs, the most recently admitted
running sequence (the tail of the running queue, possibly the sequence itself) is preempted: its blocks are
freed, `num_computed_tokens = 0`, and it goes to the FRONT of the waiting queue. Re-admitted later, it
prefills prompt + generated tokens again (in chunks, maybe with prefix-cache hits); only its final chunk is
sampled, producing the token after its last one. A preempted fork sibling simply becomes an independent
sequence. A step that preempted admits no new sequence (unless it would otherwise be empty).

**Rejection.** A sequence whose tokens need more blocks than the whole cache has is finished with
`finish_reason = "error: ..."` (naming the lengths) instead of waiting forever: at `add()` for a prompt that can
never fit, and at (re)admission for a sequence that has outgrown the cache while generating.

**Pipelining.** `postprocess` is `commit(batch)` (everything that needs no token values: KV marked computed,
forks, a `PENDING_TOKEN` appended to each receiver, max_tokens finishes) followed by `resolve(receivers, tokens,
logprobs)` (the values, and stop-token finishes). The engine may call `schedule()` for step t+1 between
commit(t) and resolve(t), while step t still runs on the GPU: step t+1 then feeds each pending token from step
t's output on the device. Without stop tokens both orders make the same batches. A sequence that stopped at
step t is still in step t+1, whose entry for it `commit` drops (resolve finished it); its one extra KV write is
the stop token's, into a block it owned, and later batches may differ from the synchronous order's (never the
tokens: the noise is keyed and the kernels batch-invariant). `resolve` also finishes a stopped sequence that
schedule() preempted meanwhile (it waits with its pending token, which is only read once resolved). The
placeholder is only ever a sequence's last token, so no prefix-cache hash covers it (hashes cover full blocks of
computed tokens, and lookups stop before the last token); resolve(t) comes before commit(t+1), which is what may
register the block holding it.

**Multi-turn.** A `multi_turn` sequence is an episode: where a single-turn one would finish ("stop",
"length"), it PAUSES (`paused` list, `take_finished()` hands it out like a finished one, so the caller can ask
the environment) and keeps its KV blocks. `resume(seq, observation, max_tokens)` appends the observation and
puts it back at the tail of the running queue: the next step prefills the turn's last sampled token (whose KV
was never written: a token is cached by the step after the one that sampled it) and the observation on top of
the cached conversation, and samples the next turn's first token. Meanwhile every other sequence keeps running;
nothing waits for a turn round. `release(seq, reason)` ends the episode and frees its blocks. Paused sequences
are the first victims when blocks run short (most recently paused first): they are idle, and their full blocks
stay in the prefix cache, so a resume after eviction usually recomputes only the last partial block.

**Order.** Running sequences are served in admission order (decodes and unfinished prefills alike), then
waiting ones in queue order while budgets and blocks allow (first-come first-served: the head is never
overtaken). All containers are lists/deques, so a given sequence of calls always produces the same batches;
the tokens a request gets do not depend on batching at all (the sampler's noise is keyed by request, sample
and position).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from exactrl.engine.block_manager import BlockManager
from exactrl.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledEntry:
    """One sequence's part of a step (see the module docstring)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    num_samples: int
    block_table: list[int]

    @property
    def end(self) -> int:
        """Tokens in the cache after this step; also the position of the token sampled from this entry."""
        return self.start + self.num_new_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end]

    @property
    def is_decode(self) -> bool:
        """One new token that continues generation (not a prefill or recompute chunk)."""
        return self.num_new_tokens == 1 and self.start >= self.seq.num_prompt_tokens


class SampleRow(NamedTuple):
    """One token to sample: from the logits row of batch.entries[entry_index], with these noise-key inputs.
    (A named tuple: immutable, and built once per row per step, so cheap to make.)"""

    entry_index: int
    request_id: int
    sample_index: int
    position: int


@dataclass
class ScheduledBatch:
    entries: list[ScheduledEntry]
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def num_sample_rows(self) -> int:
        return sum(e.num_samples for e in self.entries)

    def sample_rows(self) -> list[SampleRow]:
        """Tokens to draw this step, in the order `postprocess` expects them: entries in order, and for a fork
        entry (num_samples = n) its samples 0..n-1. Entries with num_samples = 0 contribute nothing."""
        rows: list[SampleRow] = []
        for i, e in enumerate(self.entries):
            if e.num_samples == 1:
                rows.append(SampleRow(i, e.seq.request_id, e.seq.sample_index, e.end))
            else:
                rows.extend(SampleRow(i, e.seq.request_id, j, e.end) for j in range(e.num_samples))
        return rows


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("prefill_chunk_size", prefill_chunk_size),
        ):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.block_manager = block_manager
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.prefill_chunk_size = int(prefill_chunk_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []
        self._next_seq_id = 0
        self.paused: list[Sequence] = []  # multi-turn sequences between two turns, in the order they paused
        self._in_flight: ScheduledBatch | None = None
        self.num_preemptions = 0
        self.num_paused_evictions = 0  # of those, paused multi-turn sequences that gave their blocks back

    # -- queue management ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (a prompt, with seq.num_samples samples). A prompt that can never fit the
        cache is finished at once with an "error: ..." reason and shows up in take_finished()."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"only a fresh waiting sequence can be added, got {seq}")
        if seq.num_completion_tokens:
            raise ValueError(f"sequence {seq.seq_id} already has generated tokens")
        self._next_seq_id = max(self._next_seq_id, seq.seq_id + 1)
        if self._never_fits(seq):
            self._finish(seq, self._too_long_reason(seq))
            return
        self.waiting.append(seq)

    def readmit(self, seq: Sequence) -> None:
        """Queue a single-turn sample that already generated tokens in an earlier call (a partial rollout cut
        before it finished), at the FRONT of the waiting queue, as a preempted sequence waits: it holds no KV,
        so its admission prefills prompt + generated tokens under the weights the engine holds NOW, and samples
        the token after its last one. (KV written under other weights is never extended: that would record
        logprobs that no single version's forward computes.) One that can never fit is finished with an error."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"only a waiting sequence without KV can be readmitted, got {seq}")
        if seq.multi_turn or seq.num_samples != 1:
            raise ValueError(
                f"sequence {seq.seq_id}: only a single-turn sample (num_samples = 1) is readmitted"
            )
        if len(seq.rollout_logprobs) != seq.num_completion_tokens or seq.num_turn_tokens >= seq.max_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: {seq.num_completion_tokens} generated tokens with "
                f"{len(seq.rollout_logprobs)} logprobs and max_tokens {seq.max_tokens}: nothing left to sample"
            )
        self._next_seq_id = max(self._next_seq_id, seq.seq_id + 1)
        if self._never_fits(seq):
            self._finish(seq, self._too_long_reason(seq))
            return
        self.waiting.appendleft(seq)

    def new_seq_id(self) -> int:
        """A seq id not used by any sequence added so far (forks take theirs from here too)."""
        sid = self._next_seq_id
        self._next_seq_id += 1
        return sid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[Sequence]:
        """Sequences finished since the last call, in the order they finished."""
        done, self._finished = self._finished, []
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (multi-turn: pause) a waiting or running sequence from outside (e.g. a stop string found by the
        detokenizer). Also between schedule() and commit(): the in-flight step's entry for it is then dropped."""
        if seq.turn_ended:
            raise ValueError(f"sequence {seq.seq_id} is already {seq.status.value} ({seq.finish_reason})")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def resume(self, seq: Sequence, observation: list[int], max_tokens: int) -> None:
        """Continue a paused multi-turn sequence: append the observation tokens (may be empty) and let the next
        turn sample at most max_tokens tokens. Its KV blocks (if it still holds them) are reused as they are."""
        if not seq.is_paused:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, only a paused one can be resumed")
        if seq.has_pending_token:
            raise ValueError(f"sequence {seq.seq_id}: its last sampled token is not resolved yet")
        if int(max_tokens) < 1:
            raise ValueError(f"sequence {seq.seq_id}: max_tokens must be >= 1, got {max_tokens}")
        self.paused.remove(seq)
        start = len(seq.token_ids)
        seq.token_ids.extend(int(t) for t in observation)
        seq.observation_spans.append((start, len(seq.token_ids)))
        seq.turn_start = len(seq.token_ids)
        seq.max_tokens = int(max_tokens)
        seq.finish_reason = None
        if seq.block_table:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:  # evicted while paused: recompute, ahead of newer prompts (as a preempted sequence does)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def release(self, seq: Sequence, reason: str) -> None:
        """End a paused multi-turn sequence for good (the episode is over): free its blocks, FINISHED."""
        if not seq.is_paused:
            raise ValueError(
                f"sequence {seq.seq_id} is {seq.status.value}, only a paused one can be released"
            )
        self.paused.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's work and reserve its KV blocks.

        None when nothing is left to run (what remained may just have been rejected: see take_finished());
        after None, has_unfinished() is False."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without postprocess() in between")
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        entries: list[ScheduledEntry] = []
        copies: list[tuple[int, int]] = []
        preempted = False

        # 1. Running sequences in admission order. A sequence that cannot get its blocks preempts the running
        #    tail (never an entry already in this step: those sit before it in the queue).
        i = 0
        while i < len(self.running) and len(entries) < self.max_num_seqs and budget > 0:
            seq = self.running[i]
            if bm.can_append_in_place(seq):  # the common decode step: nothing to allocate or copy
                entries.append(self._entry(seq, 1))
                budget -= 1
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, self.prefill_chunk_size, budget)
            target = seq.num_computed_tokens + num_new
            while not bm.can_allocate(seq, target):
                if self._evict_paused():
                    preempted = True
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: it was the tail, nothing is left behind it
            copies += bm.allocate(seq, target)
            entries.append(self._entry(seq, num_new))
            budget -= num_new
            i += 1

        # 2. Waiting sequences, first come first served, while budgets and free blocks allow. After a preemption
        #    nothing is admitted (it would only be preempted again), unless the step is otherwise empty.
        while (
            not (preempted and entries)
            and self.waiting
            and len(entries) < self.max_num_seqs
            and budget > 0
            and (not self.running or len(self.running) + self.waiting[0].num_samples <= self.max_num_seqs)
        ):
            seq = self.waiting[0]
            if self._never_fits(seq):
                self.waiting.popleft()
                self._finish(seq, self._too_long_reason(seq))
                continue
            cached = bm.cached_prefix_tokens(seq)
            num_new = min(seq.num_tokens - cached, self.prefill_chunk_size, budget)
            if not bm.can_allocate(seq, cached + num_new):
                if not entries and self._evict_paused():
                    continue  # nothing else runs: idle paused sequences must not stall the queue
                break
            self.waiting.popleft()
            copies += bm.allocate(seq, cached + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append(self._entry(seq, num_new))
            budget -= num_new

        if not entries:
            if self.running or self.waiting:
                raise RuntimeError(  # cannot happen with budgets >= 1; guard against a silent stall
                    f"scheduler made no progress: {len(self.running)} running, {len(self.waiting)} waiting, "
                    f"{bm.num_free_blocks} free blocks"
                )
            return None
        batch = ScheduledBatch(entries, copies)
        self._in_flight = batch
        return batch

    def postprocess(
        self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float] | None = None
    ) -> list[Sequence]:
        """Apply a step's results: token_ids[k] (and logprobs[k]) is the token drawn for batch.sample_rows()[k].

        `commit(batch)` then `resolve(...)` (see "Pipelining"). Returns the sequences that received a token, in
        row order (forked children included), so the engine can check stop strings and call finish()."""
        if batch is not self._in_flight:
            raise RuntimeError("postprocess() must get the batch returned by the last schedule()")
        if len(token_ids) != batch.num_sample_rows:
            raise ValueError(
                f"postprocess expected {batch.num_sample_rows} sampled tokens, got {len(token_ids)}"
            )
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"postprocess got {len(logprobs)} logprobs for {len(token_ids)} tokens")
        return self.resolve(self.commit(batch), token_ids, logprobs)

    def commit(self, batch: ScheduledBatch) -> list[Sequence | None]:
        """The part of a step's postprocessing that needs no token values.

        Marks the step's KV computed, forks group parents, appends a PENDING_TOKEN to every sequence that
        draws a token, and finishes those that reach max_tokens with it (their blocks are freed). Entries whose
        sequence was finished while the step was in flight are skipped. Returns, for each of
        batch.sample_rows(), the sequence its token goes to, or None where it is to be discarded: pass it to
        `resolve` with the values."""
        if batch is not self._in_flight:
            raise RuntimeError("commit() must get the batch returned by the last schedule()")
        self._in_flight = None
        bm = self.block_manager
        receivers: list[Sequence | None] = []
        children: dict[int, list[Sequence]] = {}
        for e in batch.entries:
            seq = e.seq
            if (
                seq.turn_ended
            ):  # finished/paused by finish() or a stop token while the step ran: drop its rows
                receivers.extend([None] * e.num_samples)
                continue
            bm.mark_computed(seq, e.end)
            if e.num_samples == 0:
                continue
            group = [seq]
            if e.num_samples > 1:
                seq.num_samples = 1
                for j in range(1, e.num_samples):
                    child = seq.new_sample(self.new_seq_id(), j)
                    bm.fork(seq, child)
                    group.append(child)
                children[seq.seq_id] = group[1:]
            for member in group:
                member.append_pending()
                receivers.append(member)

        if children:
            running: list[Sequence] = []
            for seq in self.running:
                running.append(seq)
                running.extend(children.get(seq.seq_id, ()))
            self.running = running
        any_finished = False
        for receiver in receivers:
            if receiver is not None and receiver.num_turn_tokens >= receiver.max_tokens:
                self._finish(receiver, "length")
                any_finished = True
        if any_finished:
            self.running = [s for s in self.running if not s.turn_ended]
        return receivers

    def resolve(
        self,
        receivers: list[Sequence | None],
        token_ids: list[int],
        logprobs: list[float] | None = None,
    ) -> list[Sequence]:
        """Give the pending tokens of a committed step their values (token_ids[k] for receivers[k]) and finish
        the sequences that drew a stop token. May run while a later step is scheduled and in flight (its entries
        of sequences finished here are dropped by its commit). Returns the sequences that received a value."""
        if len(token_ids) != len(receivers):
            raise ValueError(f"resolve got {len(token_ids)} tokens for {len(receivers)} rows")
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"resolve got {len(logprobs)} logprobs for {len(token_ids)} tokens")
        got: list[Sequence] = []
        stopped: list[Sequence] = []
        for k, seq in enumerate(receivers):
            if seq is None:
                continue
            seq.resolve_token(token_ids[k], None if logprobs is None else logprobs[k])
            got.append(seq)
            if seq.token_ids[-1] in seq.stop_token_ids:
                if seq.turn_ended:
                    # Finished (paused) since commit (max_tokens, or rejected by a schedule() that ran ahead): the stop
                    # token came first, and names the reason, as it does when nothing runs ahead.
                    seq.finish_reason = "stop"
                else:
                    stopped.append(seq)
        if stopped:
            for seq in stopped:
                if seq.status is SequenceStatus.WAITING:  # preempted by a schedule() that ran ahead
                    self.waiting.remove(seq)
                self._finish(seq, "stop")
            self.running = [s for s in self.running if not s.turn_ended]
        return got

    # -- internals -------------------------------------------------------------------------------------------
    def _entry(self, seq: Sequence, num_new: int) -> ScheduledEntry:
        start = seq.num_computed_tokens
        samples = seq.num_samples if start + num_new == seq.num_tokens else 0
        return ScheduledEntry(seq, start, num_new, samples, list(seq.block_table))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _evict_paused(self) -> bool:
        """Free the blocks of the most recently paused sequence that holds any; False when none does."""
        for seq in reversed(self.paused):
            if seq.block_table:
                self.block_manager.free(seq)
                seq.num_preemptions += 1
                self.num_preemptions += 1
                self.num_paused_evictions += 1
                return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.multi_turn and not reason.startswith("error"):
            # The end of a turn, not of the episode: keep the KV for the next turn (see "Multi-turn").
            seq.status = SequenceStatus.PAUSED
            seq.finish_reason = reason
            self.paused.append(seq)
            self._finished.append(seq)
            return
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished.append(seq)

    def _never_fits(self, seq: Sequence) -> bool:
        return self.block_manager.blocks_for(seq.num_tokens) > self.block_manager.num_blocks

    def _too_long_reason(self, seq: Sequence) -> str:
        bm = self.block_manager
        return (
            f"error: sequence of {seq.num_tokens} tokens ({seq.num_prompt_tokens} prompt + "
            f"{seq.num_completion_tokens} generated) needs {bm.blocks_for(seq.num_tokens)} KV blocks, but the "
            f"cache has only {bm.num_blocks} blocks of {bm.block_size} tokens ({bm.num_blocks * bm.block_size} tokens)"
        )
