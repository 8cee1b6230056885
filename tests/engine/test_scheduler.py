import random

import pytest

from exactrl.engine.block_manager import BlockManager
from exactrl.engine.scheduler import ScheduledBatch, Scheduler
from exactrl.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus

STOP = 0
VOCAB = 24


def _mix(x: int) -> int:
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def fake_kv(prev: int, token: int, pos: int) -> int:
    """The fake model's 'KV' of a position: a function of the whole prefix, like a real one."""
    return _mix(prev * 1000003 + token * 7919 + pos)


def fake_sample(kv_last: int, request_id: int, sample_index: int) -> int:
    return _mix(kv_last ^ (request_id << 40) ^ (sample_index << 20)) % VOCAB


def reference(prompt: list[int], request_id: int, n: int, max_tokens: int, stop: int | None = STOP):
    """What every sample must produce, computed without any cache or batching."""
    out = []
    for j in range(n):
        tokens, kv = list(prompt), 0
        for p, t in enumerate(tokens):
            kv = fake_kv(kv, t, p)
        completion: list[int] = []
        while True:
            t = fake_sample(kv, request_id, j)
            completion.append(t)
            kv = fake_kv(kv, t, len(tokens))
            tokens.append(t)
            if t == stop:
                out.append((completion, "stop"))
                break
            if len(completion) == max_tokens:
                out.append((completion, "length"))
                break
    return out


class FakeEngine:
    """Drives a Scheduler like the real engine, with a fake KV cache (one int per slot) and a fake model that
    only reads the cache. Checks budgets and that no step reads or writes a slot it must not touch.

    pipelined: every step is scheduled and run before the previous one is resolved (commit, then resolve after
    the next step has run), its pending tokens taken from `device`, the values the fake model drew. The real
    engine runs ahead only for decode steps; this runs any step ahead, the harder case."""

    def __init__(
        self,
        *,
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        prefill_chunk_size,
        prefix_caching=True,
        pipelined=False,
    ):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size,
        )
        self.cache: list[int | None] = [None] * (num_blocks * block_size)
        self.trace: list[tuple] = []
        self.results: dict[tuple[int, int], tuple[list[int], str]] = {}
        self.finished: list[Sequence] = []
        self.pipelined = pipelined
        self.pending: tuple[list, list[int], list[float]] | None = None  # committed, not resolved
        self.device: dict[int, int] = {}  # seq_id -> value of its pending token
        self.dropped_rows = 0  # rows of sequences that finished while their step was in flight

    def token(self, seq: Sequence, p: int) -> int:
        t = seq.token_ids[p]
        if t == PENDING_TOKEN:
            assert self.pipelined and p == seq.num_tokens - 1, "only the last token may be pending"
            return self.device[seq.seq_id]
        return t

    def slot(self, table: list[int], p: int) -> int:
        bs = self.bm.block_size
        return table[p // bs] * bs + p % bs

    def add(
        self, request_id: int, prompt: list[int], n: int, max_tokens: int, stop: int | None = STOP
    ) -> Sequence:
        seq = Sequence(
            self.sched.new_seq_id(),
            request_id,
            prompt,
            max_tokens=max_tokens,
            num_samples=n,
            stop_token_ids=[] if stop is None else [stop],
        )
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch | None:
        s = self.sched
        batch = s.schedule()
        if batch is None:
            if self.pending is not None:
                self.resolve()
                return self.step() if s.has_unfinished() else None
            return None
        assert batch.num_batched_tokens <= s.max_num_batched_tokens
        assert len(batch.entries) <= s.max_num_seqs
        assert len({e.seq.seq_id for e in batch.entries}) == len(batch.entries)
        self.trace.append(
            (
                [(e.seq.seq_id, e.start, e.num_new_tokens, e.num_samples) for e in batch.entries],
                list(batch.block_copies),
            )
        )
        # Copy-on-write first: gather every source, then scatter (as the model runner does).
        bs = self.bm.block_size
        dsts = [d for _, d in batch.block_copies]
        assert len(set(dsts)) == len(dsts)
        contents = [self.cache[src * bs : (src + 1) * bs] for src, _ in batch.block_copies]
        for d, c in zip(dsts, contents):
            self.cache[d * bs : (d + 1) * bs] = c
        written = set()
        for e in batch.entries:
            assert e.start == e.seq.num_computed_tokens and e.block_table == e.seq.block_table
            assert 1 <= e.num_new_tokens and (
                e.num_new_tokens == 1 or e.num_new_tokens <= s.prefill_chunk_size
            )
            for p in range(e.start, e.end):
                sl = self.slot(e.block_table, p)
                assert sl not in written, "two rows of one step write the same cache slot"
                written.add(sl)
        # The fake forward pass: every row reads all keys before it (from the cache) and writes its own.
        for e in batch.entries:
            for p in range(e.start):
                assert self.slot(e.block_table, p) not in written, "a step overwrites keys another row reads"
            for p in range(e.start, e.end):
                prev = self.cache[self.slot(e.block_table, p - 1)] if p else 0
                self.cache[self.slot(e.block_table, p)] = fake_kv(prev, self.token(e.seq, p), p)
            kv = 0
            for p in range(e.end):  # the cache must hold exactly the sequence's own prefix
                kv = fake_kv(kv, self.token(e.seq, p), p)
                assert self.cache[self.slot(e.block_table, p)] == kv, f"stale KV at {p} for {e.seq}"
        tokens, logprobs = [], []
        for row in batch.sample_rows():
            e = batch.entries[row.entry_index]
            assert row.position == e.end == e.seq.num_tokens
            tokens.append(
                fake_sample(self.cache[self.slot(e.block_table, e.end - 1)], row.request_id, row.sample_index)
            )
            logprobs.append(-float(row.position))  # tells whether each logprob lands at its token
        if not self.pipelined:
            receivers = s.postprocess(batch, tokens, logprobs)
            assert [r.last_token_id for r in receivers] == tokens
            self.collect()
            return batch
        if self.pending is not None:  # the previous step is read back while this one "runs"
            self.resolve()
        receivers = s.commit(batch)
        assert len(receivers) == len(tokens)
        for r, t in zip(receivers, tokens):
            if r is None:
                self.dropped_rows += 1
            else:
                assert r.token_ids[-1] == PENDING_TOKEN
                self.device[r.seq_id] = t
        self.pending = (receivers, tokens, logprobs)
        return batch

    def resolve(self) -> None:
        receivers, tokens, logprobs = self.pending
        self.pending = None
        got = self.sched.resolve(receivers, tokens, logprobs)
        assert got == [r for r in receivers if r is not None]
        assert [r.token_ids[-1] for r in got] == [t for r, t in zip(receivers, tokens) if r is not None]
        self.collect()

    def collect(self) -> None:
        for seq in self.sched.take_finished():
            self.finished.append(seq)
            key = (seq.request_id, seq.sample_index)
            assert key not in self.results
            assert PENDING_TOKEN not in seq.token_ids
            n = seq.num_prompt_tokens
            assert seq.rollout_logprobs == [-float(p) for p in range(n, seq.num_tokens)]
            self.results[key] = (seq.completion_token_ids, seq.finish_reason)

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                if self.pending is not None:
                    self.resolve()
                break
            if self.step() is None:  # what was left has just been rejected
                assert not self.sched.has_unfinished()
        else:
            raise AssertionError("did not finish")
        self.collect()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "KV blocks leaked"
        self.bm.check_consistency([])


def make_requests(seed: int, count: int):
    rng = random.Random(seed)
    shared = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    reqs = []
    for _ in range(count):
        prompt = list(rng.choice(shared)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        reqs.append((prompt, rng.choice([1, 1, 2, 4]), rng.randrange(1, 30)))
    return reqs


def run_all(reqs, pipelined=False, **cfg) -> FakeEngine:
    eng = FakeEngine(pipelined=pipelined, **cfg)
    for rid, (prompt, n, max_tokens) in enumerate(reqs):
        eng.add(rid, prompt, n, max_tokens)
    eng.run()
    return eng


CONFIGS = [
    dict(num_blocks=400, block_size=4, max_num_seqs=64, max_num_batched_tokens=512, prefill_chunk_size=512),
    dict(num_blocks=400, block_size=4, max_num_seqs=1, max_num_batched_tokens=512, prefill_chunk_size=512),
    dict(num_blocks=400, block_size=8, max_num_seqs=7, max_num_batched_tokens=13, prefill_chunk_size=5),
    dict(num_blocks=20, block_size=4, max_num_seqs=16, max_num_batched_tokens=64, prefill_chunk_size=16),
    dict(num_blocks=9, block_size=8, max_num_seqs=32, max_num_batched_tokens=40, prefill_chunk_size=3),
    dict(num_blocks=70, block_size=1, max_num_seqs=8, max_num_batched_tokens=9, prefill_chunk_size=4),
    dict(
        num_blocks=20,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        prefill_chunk_size=16,
        prefix_caching=False,
    ),
]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_results_do_not_depend_on_batching(cfg, pipelined):
    reqs = make_requests(0, 30)
    eng = run_all(reqs, pipelined=pipelined, **cfg)
    expected = {}
    for rid, (prompt, n, max_tokens) in enumerate(reqs):
        for j, res in enumerate(reference(prompt, rid, n, max_tokens)):
            expected[(rid, j)] = res
    assert eng.results == expected
    for seq in eng.finished:
        assert len(seq.rollout_logprobs) == seq.num_completion_tokens
    if cfg["num_blocks"] <= 20:
        assert eng.sched.num_preemptions > 0  # the small caches really exercised preemption
    if cfg.get("prefix_caching", True) and cfg["max_num_seqs"] > 1:
        assert any(s.num_cached_tokens for s in eng.finished)
    if pipelined and cfg["max_num_seqs"] > 1:
        # Sequences stopped while the next step was already scheduled: that step's rows for them were dropped.
        assert eng.dropped_rows > 0


def test_pipelined_schedules_match_sync_without_stop_tokens():
    """With no stop token, running ahead changes nothing: the same batches and block copies, step for step."""
    rng = random.Random(3)
    reqs = [
        ([rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 12))], rng.choice([1, 3]), 12)
        for _ in range(9)
    ]
    traces = []
    for pipelined in (False, True):
        eng = FakeEngine(pipelined=pipelined, **CONFIGS[3])
        for rid, (prompt, n, max_tokens) in enumerate(reqs):
            eng.add(rid, prompt, n, max_tokens, stop=None)
        eng.run()
        assert eng.sched.num_preemptions > 0
        traces.append(eng.trace)
    assert traces[0] == traces[1]


def test_resolve_rejects_misuse():
    eng = FakeEngine(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8
    )
    a = eng.add(0, [1, 2, 3], 1, 2)
    batch = eng.sched.schedule()
    receivers = eng.sched.commit(batch)
    assert receivers == [a] and a.token_ids[-1] == PENDING_TOKEN and a.has_pending_token
    with pytest.raises(RuntimeError, match="last schedule"):
        eng.sched.commit(batch)
    with pytest.raises(ValueError, match="resolve got 2 tokens for 1 rows"):
        eng.sched.resolve(receivers, [5, 6])
    with pytest.raises(ValueError, match="negative"):
        eng.sched.resolve(receivers, [-3])
    eng.sched.resolve(receivers, [5], [-1.0])
    assert a.completion_token_ids == [5] and a.rollout_logprobs == [-1.0]
    with pytest.raises(ValueError, match="no pending token"):
        eng.sched.resolve(receivers, [5])


def test_stop_token_names_the_reason_of_a_sequence_finished_at_commit():
    eng = FakeEngine(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8
    )
    a = eng.add(0, [1, 2, 3], 1, 1)
    receivers = eng.sched.commit(eng.sched.schedule())
    assert a.is_finished and a.finish_reason == "length" and a.block_table == []
    eng.sched.resolve(receivers, [STOP])
    assert a.finish_reason == "stop" and a.completion_token_ids == [STOP]


def test_schedule_is_deterministic():
    reqs = make_requests(1, 20)
    cfg = CONFIGS[3]
    assert run_all(reqs, **cfg).trace == run_all(reqs, **cfg).trace


def test_chunked_prefill_respects_budgets():
    eng = FakeEngine(
        num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=20, prefill_chunk_size=16
    )
    a = eng.add(0, list(range(1, 51)), 1, 3)
    b = eng.add(1, list(range(1, 11)), 1, 3)
    steps = []
    while a.num_completion_tokens == 0 or b.num_completion_tokens == 0:
        batch = eng.step()
        steps.append([(e.seq.request_id, e.start, e.num_new_tokens, e.num_samples) for e in batch.entries])
    assert steps[0] == [(0, 0, 16, 0), (1, 0, 4, 0)]
    assert steps[1] == [(0, 16, 16, 0), (1, 4, 4, 0)]
    assert steps[2] == [(0, 32, 16, 0), (1, 8, 2, 1)]  # b's last chunk is sampled
    assert steps[3] == [(0, 48, 2, 1), (1, 10, 1, 1)]  # a finishes its prefill while b decodes


def test_decodes_are_batched_and_new_requests_join():
    eng = FakeEngine(
        num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64
    )
    for rid in range(3):
        eng.add(rid, [rid + 1] * 5, 1, 50, stop=None)
    first = eng.step()
    assert [(e.start, e.num_new_tokens, e.num_samples) for e in first.entries] == [(0, 5, 1)] * 3
    second = eng.step()
    assert [(e.seq.request_id, e.start, e.num_new_tokens, e.is_decode) for e in second.entries] == [
        (r, 5, 1, True) for r in range(3)
    ]
    eng.add(3, [9] * 7, 1, 5)
    third = eng.step()
    assert [(e.seq.request_id, e.start, e.num_new_tokens) for e in third.entries] == [
        (0, 6, 1),
        (1, 6, 1),
        (2, 6, 1),
        (3, 0, 7),
    ]


def test_fork_group_shares_prompt_and_copies_on_write():
    eng = FakeEngine(
        num_blocks=100,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prefill_chunk_size=64,
        prefix_caching=False,
    )
    parent = eng.add(0, [3, 4, 5, 6, 7, 8], 4, 10)
    first = eng.step()
    (entry,) = first.entries
    assert entry.num_samples == 4
    assert [(r.sample_index, r.position) for r in first.sample_rows()] == [(j, 6) for j in range(4)]
    running = eng.sched.running
    assert [s.sample_index for s in running] == [0, 1, 2, 3] and running[0] is parent
    assert all(s.block_table == parent.block_table and s.num_computed_tokens == 6 for s in running)
    assert all(eng.bm.ref_count(b) == 4 for b in parent.block_table)
    assert parent.num_samples == 1
    second = eng.step()
    # Three siblings get private copies of the shared partial block, the last one writes in place.
    live = [e for e in second.entries]
    assert len(second.block_copies) == len(live) - 1 == 3
    srcs = {s for s, _ in second.block_copies}
    assert srcs == {parent.block_table[1]} or srcs == {running[-1].block_table[1]}
    eng.run()
    expected = reference([3, 4, 5, 6, 7, 8], 0, 4, 10)
    assert [eng.results[(0, j)] for j in range(4)] == expected


def test_group_larger_than_max_num_seqs_still_runs():
    eng = FakeEngine(
        num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=64
    )
    eng.add(0, [1, 2, 3], 5, 6)
    eng.add(1, [4, 5, 6], 1, 6)
    eng.run()
    assert [eng.results[(0, j)] for j in range(5)] == reference([1, 2, 3], 0, 5, 6)
    assert eng.results[(1, 0)] == reference([4, 5, 6], 1, 1, 6)[0]


def test_preemption_recomputes_later():
    # 4 blocks of 4 tokens; two sequences of 6 prompt tokens each need 2 blocks now and more as they grow.
    eng = FakeEngine(
        num_blocks=4,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=64,
        prefix_caching=False,
    )
    a = eng.add(0, [1, 2, 3, 4, 5, 6], 1, 8, stop=None)
    b = eng.add(1, [7, 8, 9, 10, 11, 12], 1, 8, stop=None)
    eng.step()
    assert a.status is b.status is SequenceStatus.RUNNING and eng.bm.num_free_blocks == 0
    eng.step()  # both decode position 6 (still in their second block)
    eng.step()  # position 7
    batch = eng.step()  # position 8 needs a third block each: b (the tail) is preempted for a
    assert [e.seq for e in batch.entries] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.block_table == [] and b.num_computed_tokens == 0 and eng.sched.waiting[0] is b
    generated = b.num_completion_tokens
    while b.status is SequenceStatus.WAITING:
        batch = eng.step()
    (entry,) = [e for e in batch.entries if e.seq is b]
    assert entry.start == 0 and entry.num_new_tokens == 6 + generated and entry.num_samples == 1
    eng.run()
    assert eng.results[(0, 0)] == reference([1, 2, 3, 4, 5, 6], 0, 1, 8, stop=None)[0]
    assert eng.results[(1, 0)] == reference([7, 8, 9, 10, 11, 12], 1, 1, 8, stop=None)[0]


def test_preempted_fork_siblings_become_independent():
    eng = FakeEngine(
        num_blocks=6,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prefill_chunk_size=64,
        prefix_caching=False,
    )
    eng.add(0, [5, 6, 7, 8, 9], 4, 12, stop=None)
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert [eng.results[(0, j)] for j in range(4)] == reference([5, 6, 7, 8, 9], 0, 4, 12, stop=None)


def test_prompt_that_never_fits_is_rejected():
    eng = FakeEngine(
        num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8
    )
    seq = eng.add(0, list(range(1, 14)), 1, 4)
    assert seq.is_finished
    (done,) = eng.sched.take_finished()
    assert done is seq and done.finish_reason.startswith("error:")
    assert "13 tokens" in done.finish_reason and "3 blocks of 4 tokens" in done.finish_reason
    assert eng.sched.schedule() is None


def test_sequence_outgrowing_the_cache_is_finished_with_an_error():
    eng = FakeEngine(
        num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8
    )
    # No stop token: it grows until the cache is full.
    eng.sched.add(Sequence(0, 0, [1, 2, 3], max_tokens=100))
    eng.run()
    (completion, reason) = eng.results[(0, 0)]
    assert reason.startswith("error:") and "9 tokens (3 prompt + 6 generated)" in reason
    assert len(completion) == 6


def test_finish_from_outside_and_misuse():
    eng = FakeEngine(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8
    )
    a = eng.add(0, [1, 2, 3], 1, 10)
    b = eng.add(1, [4, 5, 6], 1, 10)
    batch = eng.sched.schedule()
    with pytest.raises(RuntimeError, match="twice"):
        eng.sched.schedule()
    with pytest.raises(ValueError, match="expected 2 sampled tokens"):
        eng.sched.postprocess(batch, [1])
    eng.sched.postprocess(batch, [1, 1])
    # Finished while its step is in flight: the step's row for it is dropped.
    batch = eng.sched.schedule()
    eng.sched.finish(a, "stop")
    assert a.finish_reason == "stop" and a.block_table == [] and eng.sched.running == [b]
    assert eng.sched.postprocess(batch, [7, 8]) == [b]
    assert a.completion_token_ids == [1] and b.completion_token_ids == [1, 8]
    with pytest.raises(ValueError, match="already finished"):
        eng.sched.finish(a, "stop")
    with pytest.raises(ValueError, match="fresh waiting"):
        eng.sched.add(b)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(eng.bm, max_num_seqs=0, max_num_batched_tokens=1, prefill_chunk_size=1)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=["roomy", "preempting"])
def test_each_sample_of_a_group_keeps_its_own_max_tokens(cfg, pipelined):
    """A group parent's per-sample limits reach its forks (exactrl bench rl draws one length per sample), also
    through preemption and when steps run ahead; limits are checked when set."""
    rng = random.Random(5)
    eng = FakeEngine(pipelined=pipelined, **cfg)
    limits = {}
    for rid in range(6):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))]
        lim = [rng.randrange(1, 20) for _ in range(4)]
        eng.add(rid, prompt, 4, 30, stop=None).set_max_tokens_per_sample(lim)
        limits[rid] = (prompt, lim)
    eng.run()
    for rid, (prompt, lim) in limits.items():
        for j in range(4):
            assert eng.results[(rid, j)] == reference(prompt, rid, 4, lim[j], stop=None)[j]
    if cfg is CONFIGS[3]:
        assert eng.sched.num_preemptions > 0
    seq = Sequence(0, 0, [1, 2], max_tokens=8, num_samples=2)
    for bad in ([3], [3, 0], [3, 4, 5]):
        with pytest.raises(ValueError, match="max_tokens_per_sample"):
            seq.set_max_tokens_per_sample(bad)
    assert seq.max_tokens == 8 and seq.max_tokens_per_sample is None
