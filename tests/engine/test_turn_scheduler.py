"""The scheduler's multi-turn bookkeeping without a model: a turn's end pauses a sequence with its KV blocks,
resume appends the observation and prefills only what is new, release frees, paused sequences are evicted first."""

import pytest

from exactrl.engine.block_manager import BlockManager
from exactrl.engine.scheduler import Scheduler
from exactrl.engine.sequence import Sequence, SequenceStatus


def _sched(num_blocks=16):
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)


def _run_step(s, token=7):
    b = s.schedule()
    s.postprocess(b, [token] * b.num_sample_rows, [-1.0] * b.num_sample_rows)
    return b


def test_pause_resume_release():
    s = _sched()
    seq = Sequence(0, 0, [1, 2, 3, 4, 5], max_tokens=2, multi_turn=True)
    s.add(seq)
    _run_step(s)  # prefill, samples token 5
    _run_step(s)  # decode: second token of the turn: max_tokens reached -> paused, not finished
    assert seq.status is SequenceStatus.PAUSED and seq.finish_reason == "length"
    assert s.take_finished() == [seq] and seq.block_table and not s.has_unfinished()
    blocks = list(seq.block_table)
    with pytest.raises(ValueError, match="only a paused one"):
        s.release(Sequence(9, 9, [1], max_tokens=1), "x")
    s.resume(seq, [40, 41, 42], max_tokens=1)
    assert (
        seq.observation_spans == [(7, 10)] and seq.turn_start == 10 and seq.status is SequenceStatus.RUNNING
    )
    b = _run_step(s)
    # Only the turn's last sampled token (never cached) and the observation are computed, on the same blocks.
    assert [(e.start, e.num_new_tokens) for e in b.entries] == [(6, 4)]
    assert seq.block_table[:2] == blocks[:2] and seq.status is SequenceStatus.PAUSED
    assert seq.rollout_logprobs == [-1.0] * 3 and seq.turn_token_ids == [7]
    s.release(seq, "done")
    assert seq.is_finished and not seq.block_table and s.block_manager.num_free_blocks == 16
    with pytest.raises(ValueError, match="only a paused one can be resumed"):
        s.resume(seq, [1], 1)


def test_paused_sequences_are_evicted_before_running_ones_and_resume_by_recompute():
    s = _sched(num_blocks=4)  # 16 token slots
    a = Sequence(0, 0, [1, 2, 3, 4, 5, 6], max_tokens=1, multi_turn=True)
    s.add(a)
    _run_step(s)
    assert a.is_paused and len(a.block_table) == 2
    b = Sequence(1, 1, list(range(10, 22)), max_tokens=1)  # 12 tokens: needs 3 blocks, 2 are free
    s.add(b)
    _run_step(s)
    assert not a.block_table and a.is_paused and s.num_paused_evictions == 1 and b.is_finished
    s.resume(a, [50], max_tokens=1)
    assert a.status is SequenceStatus.WAITING  # no blocks left: recomputed from the start
    step = _run_step(s)
    assert [(e.start, e.num_new_tokens) for e in step.entries] == [(0, 8)]
    s.block_manager.check_consistency([a])
