import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.engine.block_manager import BlockManager, OutOfBlocksError
from exactrl.engine.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int], max_tokens: int = 100) -> Sequence:
    return Sequence(seq_id, seq_id, tokens, max_tokens=max_tokens)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
    """Allocate and mark computed (what one scheduled step does, minus the model)."""
    copies = bm.allocate(seq, num_tokens)
    bm.mark_computed(seq, num_tokens)
    return copies


def test_allocate_grow_free():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3 and bm.can_allocate(seq, 10)
    assert compute(bm, seq, 10) == []
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 10 and bm.num_free_blocks == 5
    seq.append_token(99)
    seq.append_token(98)
    assert bm.blocks_needed(seq, 11) == 0  # slot 10 still fits in the third block
    compute(bm, seq, 11)
    assert len(seq.block_table) == 3
    assert bm.blocks_needed(seq, 12) == 0
    seq.append_token(97)
    compute(bm, seq, 12)
    assert bm.blocks_needed(seq, 13) == 1
    compute(bm, seq, 13)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)
    bm.check_consistency([seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8
    bm.check_consistency([])


def test_chunked_allocation_only_covers_the_chunk():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(20)))
    compute(bm, seq, 6)
    assert len(seq.block_table) == 2
    compute(bm, seq, 13)
    assert len(seq.block_table) == 4 and seq.num_computed_tokens == 13


def test_fork_shares_blocks_and_copy_on_write():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = make_seq(0, [1, 2, 3, 4, 5, 6])
    compute(bm, parent, 6)
    b0, b1 = parent.block_table
    child = parent.new_sample(1, 1)
    bm.fork(parent, child)
    assert child.block_table == [b0, b1] and child.num_computed_tokens == 6
    assert bm.ref_count(b0) == bm.ref_count(b1) == 2
    assert bm.num_free_blocks == 6
    bm.check_consistency([parent, child])

    child.append_token(7)
    parent.append_token(8)
    assert not bm.can_append_in_place(child)  # b1 is shared: copy-on-write first
    # The child writes position 6, inside the shared partial block b1: it gets a private copy.
    assert bm.blocks_needed(child, 7) == 1
    copies = bm.allocate(child, 7)
    new = child.block_table[1]
    assert copies == [(b1, new)] and new not in (b0, b1)
    assert bm.stats == {"prefix_hit_blocks": 0, "fork_shared_blocks": 2, "cow_copies": 1}
    assert bm.ref_count(b1) == 1 and bm.ref_count(new) == 1 and bm.ref_count(b0) == 2
    # The parent is now the only user of b1: it writes in place.
    assert bm.can_append_in_place(parent) and bm.can_append_in_place(child)  # both own their block 1 now
    assert bm.blocks_needed(parent, 7) == 0
    assert bm.allocate(parent, 7) == []
    assert parent.block_table == [b0, b1]
    bm.check_consistency([parent, child])
    bm.free(parent)
    assert bm.ref_count(b0) == 1 and bm.ref_count(b1) == 0
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check_consistency([])


def test_fork_on_block_boundary_needs_no_copy():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = make_seq(0, list(range(8)))
    compute(bm, parent, 8)
    children = []
    for j in range(1, 4):
        c = parent.new_sample(j, j)
        bm.fork(parent, c)
        children.append(c)
    for s in [parent, *children]:
        s.append_token(50 + s.sample_index)
        assert not bm.can_append_in_place(s)  # position 8 starts a block nobody holds yet
        assert bm.allocate(s, 9) == []
        assert len(s.block_table) == 3
    assert all(bm.ref_count(b) == 4 for b in parent.block_table[:2])
    bm.check_consistency([parent, *children])


def test_prefix_cache_hit_leaves_one_token():
    bm = BlockManager(16, 4)
    a = make_seq(0, list(range(10)))
    compute(bm, a, 10)
    assert bm.num_cached_blocks == 2  # only full, computed blocks are registered

    b = make_seq(1, list(range(8)) + [77, 78, 79])
    assert bm.cached_prefix_tokens(b) == 8
    assert bm.blocks_needed(b, 11) == 1
    compute(bm, b, 11)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.ref_count(a.block_table[0]) == 2

    # Exactly two cached blocks of tokens: the last token must be recomputed, so only one block is reused.
    c = make_seq(2, list(range(8)))
    assert bm.cached_prefix_tokens(c) == 4
    copies = bm.allocate(c, 8)
    assert copies == [] and c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert bm.stats == {"prefix_hit_blocks": 2 + 1, "fork_shared_blocks": 0, "cow_copies": 0}
    assert c.block_table[1] != a.block_table[1]
    bm.mark_computed(c, 8)

    # A differing first block means no hit at all (hashes are chained).
    d = make_seq(3, [9, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.cached_prefix_tokens(d) == 0
    bm.check_consistency([a, b, c])


def test_prefix_cache_reuse_after_free_and_eviction():
    bm = BlockManager(6, 4)
    a = make_seq(0, list(range(12)))
    compute(bm, a, 12)
    blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3

    b = make_seq(1, list(range(12)) + [5])
    assert bm.cached_prefix_tokens(b) == 12
    assert bm.blocks_needed(b, 13) == 4  # 3 revived from the free list + 1 new
    compute(bm, b, 13)
    assert b.block_table[:3] == blocks and bm.num_free_blocks == 2
    bm.free(b)

    # Fill the cache with unrelated tokens: unregistered blocks go first, then the cached ones are evicted.
    c = make_seq(2, [100 + i for i in range(24)])
    compute(bm, c, 24)
    assert bm.num_cached_blocks == 6  # c's blocks replaced every old registration
    d = make_seq(3, list(range(12)) + [5])
    assert bm.cached_prefix_tokens(d) == 0
    bm.check_consistency([c])


def test_unregistered_free_blocks_are_handed_out_before_registered_ones():
    bm = BlockManager(4, 4)
    a = make_seq(0, list(range(6)))  # one full registered block, one partial
    compute(bm, a, 6)
    bm.free(a)
    b = make_seq(1, [50, 51, 52])
    compute(bm, b, 3)
    c = make_seq(2, list(range(5)))
    assert bm.cached_prefix_tokens(c) == 4  # the registered block survived b's allocation


def test_identical_content_from_siblings_is_deduplicated():
    bm = BlockManager(10, 4)
    p = make_seq(0, [1, 2])
    compute(bm, p, 2)
    c = p.new_sample(1, 1)
    bm.fork(p, c)
    for s in (p, c):
        s.token_ids.extend([3, 4])  # both siblings produce the same block content
        bm.allocate(s, 4)
        bm.mark_computed(s, 4)
    assert p.block_table[0] != c.block_table[0]
    assert bm.num_cached_blocks == 1
    bm.free(c)
    bm.free(p)
    bm.check_consistency([])
    assert bm.cached_prefix_tokens(make_seq(2, [1, 2, 3, 4, 5])) == 4


def test_errors_on_misuse():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(6)))
    with pytest.raises(ValueError, match="holds no KV blocks"):
        bm.free(seq)
    with pytest.raises(ValueError, match="has 6 tokens"):
        bm.allocate(seq, 7)
    compute(bm, seq, 6)
    with pytest.raises(ValueError, match="already computed"):
        bm.allocate(seq, 6)
    with pytest.raises(ValueError, match="already computed"):
        bm.prepare_write(seq, 2, 3)
    with pytest.raises(ValueError, match="cannot mark"):
        bm.mark_computed(seq, 5)
    other = make_seq(1, list(range(6)))
    compute(bm, other, 6)
    with pytest.raises(ValueError, match="already holds KV blocks"):
        bm.fork(seq, other)
    with pytest.raises(ValueError, match="does not start with"):
        bm.fork(seq, make_seq(2, [9] * 6))
    with pytest.raises(ValueError, match="into itself"):
        bm.fork(seq, seq)
    big = make_seq(3, list(range(9)))
    assert not bm.can_allocate(big, 9)
    with pytest.raises(OutOfBlocksError, match="needs 3 free KV blocks"):
        bm.allocate(big, 9)
    assert big.block_table == [] and bm.num_free_blocks == 0  # nothing half-done
    bm.free(seq)
    with pytest.raises(ValueError, match="double free"):
        bm.free(seq)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_stale_table_is_detected():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(6)))
    compute(bm, seq, 6)
    stale = list(seq.block_table)
    bm.free(seq)
    seq.block_table = stale
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)


# ---------------------------------------------------------------------------------------------------------------
# Property test: random allocate / write / fork / free programs against a fake KV cache
# ---------------------------------------------------------------------------------------------------------------
def _kv(prev: int, token: int, pos: int) -> int:
    """Fake KV of position pos: depends on the whole prefix, like a real one."""
    return hash((prev, token, pos))


def _reference_kv(tokens: list[int]) -> list[int]:
    out, prev = [], 0
    for p, t in enumerate(tokens):
        prev = _kv(prev, t, p)
        out.append(prev)
    return out


def _run_program(seed: int, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    cache: list[int | None] = [None] * (num_blocks * block_size)
    live: list[Sequence] = []
    next_id = 0

    def slot(seq: Sequence, p: int) -> int:
        return seq.block_table[p // block_size] * block_size + p % block_size

    def check_contents() -> None:
        for s in live:
            ref = _reference_kv(s.token_ids)
            for p in range(s.num_computed_tokens):
                assert cache[slot(s, p)] == ref[p], f"KV of {s} at position {p} is wrong"

    for _ in range(120):
        op = rng.random()
        if op < 0.25 or not live:
            prefix = [rng.randrange(2) for _ in range(rng.randrange(1, 3 * block_size))]
            live.append(make_seq(next_id, prefix))
            next_id += 1
        elif op < 0.75:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(2))
            floor = seq.num_computed_tokens if seq.block_table else bm.cached_prefix_tokens(seq)
            target = rng.randint(floor + 1, seq.num_tokens)
            need = bm.blocks_needed(seq, target)
            if not bm.can_allocate(seq, target):
                with pytest.raises(OutOfBlocksError):
                    bm.allocate(seq, target)
                continue
            free_before = bm.num_free_blocks
            in_place = bm.can_append_in_place(seq)  # the scheduler's fast path skips allocate() when True
            table_before = list(seq.block_table)
            copies = bm.allocate(seq, target)
            assert bm.num_free_blocks == free_before - need
            if in_place:
                assert copies == [] and need == 0 and seq.block_table == table_before
            blocks = [cache[s * block_size : (s + 1) * block_size] for s, _ in copies]
            for (_, d), content in zip(copies, blocks):
                cache[d * block_size : (d + 1) * block_size] = content
            ref = _reference_kv(seq.token_ids)
            for p in range(seq.num_computed_tokens, target):
                assert bm.ref_count(seq.block_table[p // block_size]) == 1, "write into a shared block"
                cache[slot(seq, p)] = ref[p]
            bm.mark_computed(seq, target)
        elif op < 0.88:
            parent = rng.choice(live)
            if parent.block_table:
                child = make_seq(next_id, list(parent.token_ids))
                next_id += 1
                bm.fork(parent, child)
                live.append(child)
        else:
            seq = live.pop(rng.randrange(len(live)))
            if seq.block_table:
                bm.free(seq)
        bm.check_consistency([s for s in live if s.block_table])
        check_contents()

    for seq in live:
        if seq.block_table:
            bm.free(seq)
    bm.check_consistency([])
    assert bm.num_free_blocks == num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
    prefix_caching=st.booleans(),
)
def test_random_programs_keep_books_and_contents(seed, num_blocks, block_size, prefix_caching):
    _run_program(seed, num_blocks, block_size, prefix_caching)
