"""Paged KV-cache bookkeeping: which block holds which sequence's tokens. No tensors live here.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence's `block_table` maps its token `p` to
block `block_table[p // block_size]`, slot `p % block_size`. Blocks are reference counted, so several sequences
can point at one block:

* **fork** (parallel sampling): the n samples of a prompt share every block of the prefilled prompt.
* **copy-on-write**: before a sequence writes into a block that someone else also points at (the partly
  filled last prompt block after a fork), `prepare_write` gives it a private block and returns the
  `(src, dst)` copy the model runner must perform before the step's forward pass. The manager only books; the
  caller copies.
* **prefix caching** (optional): once a block is full *and its KV is computed* (`mark_computed`), it is
  registered under a hash of its tokens chained with the previous block's hash. A sequence being admitted
  (empty block table) reuses the longest run of registered blocks matching its leading full blocks, and its
  `num_computed_tokens` starts after them. At least one token is always left to compute, so the step that
  finishes the prefill has a logits row to sample from. A registered block keeps its hash while it sits in the
  free list and can be revived by a later hit, until it is handed out as a fresh block.

A block that is registered is never written again: writes only go to positions >= num_computed_tokens, and
registered blocks only hold computed positions. Free blocks are handed out oldest-released first, with
unregistered ones ahead of registered ones (those are kept as long as possible for later hits). Everything is
ordered (lists, insertion-ordered dicts), so the same calls always give the same block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from exactrl.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """An allocation needed more free blocks than there are (check `can_allocate` first)."""


def chain_hash(previous: bytes, token_ids: list[int]) -> bytes:
    """128-bit hash of one full block's tokens chained with the hash of the block before it (b"" for the first)."""
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * self.num_blocks
        # Free blocks in hand-out order (front first). An OrderedDict gives O(1) removal on a prefix-cache hit.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self._block_hash: list[bytes | None] = [None] * self.num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # What the bookkeeping did (read by `exactrl parity` to say what a check exercised).
        self.stats = {"prefix_hit_blocks": 0, "fork_shared_blocks": 0, "cow_copies": 0}

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence points at (registered ones included: they are reclaimed when handed out)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by a prefix-cache lookup."""
        return len(self._hash_to_block)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens a sequence being admitted would take from the prefix cache (0 if it already holds blocks)."""
        if seq.block_table:
            return 0
        return len(self._lookup(seq)) * self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks `allocate(seq, num_tokens)` would consume (new blocks, copy-on-write copies, and
        prefix-cache hits revived from the free list)."""
        self._check_target(seq, num_tokens)
        if not seq.block_table:
            hits = self._lookup(seq)
            revived = sum(1 for b in hits if self._ref[b] == 0)
            return self.blocks_for(num_tokens) - len(hits) + revived
        grow = max(0, self.blocks_for(num_tokens) - len(seq.block_table))
        return grow + len(self._shared_in_range(seq, seq.num_computed_tokens, num_tokens - 1))

    def can_append_in_place(self, seq: Sequence) -> bool:
        """Whether seq's one uncomputed token (a decode step) goes into a block it already owns alone, so that
        `allocate(seq, seq.num_tokens)` would take no block and copy nothing: the scheduler's fast path."""
        pos = seq.num_computed_tokens
        i = pos // self.block_size
        return seq.num_tokens == pos + 1 and i < len(seq.block_table) and self._ref[seq.block_table[i]] == 1

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    # -- allocation ------------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make seq ready to write the KV of its tokens num_computed_tokens .. num_tokens-1.

        A sequence with an empty block table is being admitted: it first takes its cached prefix (advancing
        num_computed_tokens). Then the table grows to cover num_tokens tokens, and shared blocks in the write
        range are replaced by private copies. Returns the `(src, dst)` block copies to perform before writing.
        """
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.seq_id} needs {need} free KV blocks for {num_tokens} tokens, "
                f"only {len(self._free)} of {self.num_blocks} are free"
            )
        if not seq.block_table:
            hits = self._lookup(seq)
            for b in hits:
                self._take(b)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            self.stats["prefix_hit_blocks"] += len(hits)
        copies = self.prepare_write(seq, seq.num_computed_tokens, num_tokens - 1)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_fresh())
        return copies

    def prepare_write(self, seq: Sequence, first_pos: int, last_pos: int) -> list[tuple[int, int]]:
        """Copy-on-write for positions first_pos..last_pos: each block of seq's table in that range that another
        sequence also points at is replaced by a fresh private block. Returns the `(src, dst)` copies the caller
        must perform (whole blocks, before the forward pass writes). Positions past the table are ignored."""
        if first_pos < seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot write position {first_pos}, positions < "
                f"{seq.num_computed_tokens} are already computed"
            )
        if last_pos < first_pos:
            raise ValueError(f"prepare_write needs first_pos <= last_pos, got {first_pos} > {last_pos}")
        shared = self._shared_in_range(seq, first_pos, last_pos)
        if len(shared) > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.seq_id} needs {len(shared)} blocks for copy-on-write, only {len(self._free)} free"
            )
        copies: list[tuple[int, int]] = []
        for i in shared:
            src = seq.block_table[i]
            dst = self._take_fresh()
            self._ref[src] -= 1  # still >= 1: it was shared
            seq.block_table[i] = dst
            copies.append((src, dst))
        self.stats["cow_copies"] += len(shared)
        for i in range(
            first_pos // self.block_size, min(last_pos // self.block_size + 1, len(seq.block_table))
        ):
            if self._block_hash[seq.block_table[i]] is not None:
                raise RuntimeError(
                    f"sequence {seq.seq_id} would write into block {seq.block_table[i]}, which is registered in "
                    "the prefix cache (full and computed); the block table is corrupt"
                )
        return copies

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that tokens 0..num_tokens-1 of seq now have their KV in the cache (after a forward pass), and
        register the blocks that became full in the prefix cache."""
        old = seq.num_computed_tokens
        if not old <= num_tokens <= min(seq.num_tokens, len(seq.block_table) * self.block_size):
            raise ValueError(
                f"sequence {seq.seq_id}: cannot mark {num_tokens} tokens computed (had {old}, has "
                f"{seq.num_tokens} tokens and {len(seq.block_table)} blocks of {self.block_size})"
            )
        seq.num_computed_tokens = num_tokens
        if not self.enable_prefix_caching:
            return
        for i in range(old // self.block_size, num_tokens // self.block_size):
            self._register(seq.block_table[i], self._hash_of(seq, i))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child every block of parent (reference counts + 1) and parent's computed-token count.

        child must hold no blocks and start with parent's computed tokens."""
        if child is parent:
            raise ValueError(f"sequence {parent.seq_id} cannot be forked into itself")
        if child.block_table or child.num_computed_tokens:
            raise ValueError(f"fork target {child.seq_id} already holds KV blocks")
        n = parent.num_computed_tokens
        if child.token_ids[:n] != parent.token_ids[:n]:
            raise ValueError(
                f"fork target {child.seq_id} does not start with parent {parent.seq_id}'s {n} computed tokens"
            )
        for b in parent.block_table:
            if self._ref[b] <= 0:
                raise RuntimeError(
                    f"sequence {parent.seq_id} points at free block {b}; the block table is corrupt"
                )
        for b in parent.block_table:
            self._ref[b] += 1
        self.stats["fork_shared_blocks"] += len(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = n
        child.block_hashes = parent.block_hashes[: n // self.block_size]

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody points at any more return to the free list. Leaves seq with an
        empty block table and num_computed_tokens = 0."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no KV blocks (double free?)")
        for b in seq.block_table:
            if self._ref[b] <= 0:
                raise RuntimeError(f"sequence {seq.seq_id} points at free block {b} (double free?)")
        # Last blocks first, so a prompt's leading blocks are the last of this sequence to be handed out again.
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def check_consistency(self, live: Iterable[Sequence]) -> None:
        """Assert the books balance against the sequences that hold blocks (tests and debugging)."""
        refs = [0] * self.num_blocks
        for seq in live:
            if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
                raise AssertionError(f"{seq} has computed tokens outside its blocks")
            for b in seq.block_table:
                refs[b] += 1
        if refs != self._ref:
            bad = [b for b in range(self.num_blocks) if refs[b] != self._ref[b]]
            raise AssertionError(f"reference counts disagree with block tables for blocks {bad[:10]}")
        free = [b for b in range(self.num_blocks) if self._ref[b] == 0]
        if sorted(self._free) != free:
            raise AssertionError("free list does not hold exactly the unreferenced blocks")
        for h, b in self._hash_to_block.items():
            if self._block_hash[b] != h:
                raise AssertionError(f"prefix cache maps a hash to block {b}, which has another hash")

    # -- internals -------------------------------------------------------------------------------------------
    def _check_target(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens > seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens; cannot allocate KV for {num_tokens}"
            )
        if seq.block_table:
            floor = seq.num_computed_tokens
        else:
            if seq.num_computed_tokens:
                raise ValueError(f"sequence {seq.seq_id} has computed tokens but no KV blocks")
            floor = len(self._lookup(seq)) * self.block_size
        if num_tokens <= floor:
            raise ValueError(
                f"sequence {seq.seq_id}: allocate needs num_tokens > the {floor} tokens already computed "
                f"(or cached), got {num_tokens}"
            )

    def _hash_of(self, seq: Sequence, i: int) -> bytes:
        """Chained hash of full block i of seq's tokens (memoised on the sequence)."""
        memo, bs = seq.block_hashes, self.block_size
        while len(memo) <= i:
            j = len(memo)
            memo.append(chain_hash(memo[j - 1] if j else b"", seq.token_ids[j * bs : (j + 1) * bs]))
        return memo[i]

    def _lookup(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            b = self._hash_to_block.get(self._hash_of(seq, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def _shared_in_range(self, seq: Sequence, first_pos: int, last_pos: int) -> list[int]:
        """Indices into seq's table of blocks holding positions first_pos..last_pos that others point at too."""
        stop = min(last_pos // self.block_size + 1, len(seq.block_table))
        return [i for i in range(first_pos // self.block_size, stop) if self._ref[seq.block_table[i]] > 1]

    def _take(self, b: int) -> None:
        """One more reference to block b (a prefix-cache hit), reviving it from the free list if needed."""
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def _take_fresh(self) -> int:
        """Hand out the next free block, forgetting whatever it cached."""
        b, _ = self._free.popitem(last=False)
        h = self._block_hash[b]
        if h is not None:
            if self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]
            self._block_hash[b] = None
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free[b] = None
            if self._block_hash[b] is None:
                self._free.move_to_end(b, last=False)

    def _register(self, b: int, h: bytes) -> None:
        old_hash = self._block_hash[b]
        if old_hash is not None:
            if old_hash != h:
                raise RuntimeError(f"block {b} is registered under another hash; the block table is corrupt")
            return
        self._block_hash[b] = h
        previous = self._hash_to_block.get(h)
        if previous is not None and previous != b and self._ref[previous] == 0:
            # The same content is cached twice; keep the block in use, let the idle twin be reused first.
            self._block_hash[previous] = None
            self._free.move_to_end(previous, last=False)
        self._hash_to_block[h] = b
