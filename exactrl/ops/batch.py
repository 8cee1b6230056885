"""The attention description shared by the training path (packed sequences) and the rollout path (paged KV cache).

The model never sees padding: queries are a flat stream of `T` rows, grouped by sequence. For every query row we
know its sequence and its absolute position; for every sequence we know where key position `n` lives (its
*slot*). In training the slots index the packed `k`/`v` of the same call; in rollout they index the flattened
paged cache `[num_blocks * block_size, Hkv, Dh]`. Attention iterates keys from position 0 in fixed tiles, so the
same query gives the same bits whichever way its keys are stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Keys are processed in tiles of this many positions. Every backend uses the same tile, and the KV page size
# must be a multiple of it, so that a tile never straddles two pages.
BLOCK_N = 16


@dataclass
class AttentionBatch:
    """Where each query row sits and where each sequence's keys live.

    q_seq: [T] int64, sequence index of each query row (rows of one sequence are contiguous).
    q_pos: [T] int64, absolute position of each query row inside its sequence.
    cu_seqlens_q: [B+1] int64, query row offsets of each sequence.
    key_lens: [B] int64, number of keys each sequence can see after this call (last query position + 1).
    key_slots: [B, L] int64, slot of key position n of sequence b, L a multiple of BLOCK_N; entries past
        key_lens point at slot 0 (always valid memory, always masked).
    slot_mapping: [T] int64 or None, cache slot where each row's new k/v is written (rollout only).
    block_tables: [B, max_blocks] int32 or None, paged-cache block ids (rollout only; GPU kernels read these).
    block_size: int, tokens per KV page (rollout only).
    max_seqlen_q: int, most query rows of one sequence.
    max_key_len: int, largest entry of key_lens.
    """

    q_seq: torch.Tensor
    q_pos: torch.Tensor
    cu_seqlens_q: torch.Tensor
    key_lens: torch.Tensor
    key_slots: torch.Tensor
    max_seqlen_q: int
    max_key_len: int
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    block_size: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.key_lens.numel())

    @property
    def is_paged(self) -> bool:
        return self.slot_mapping is not None

    @staticmethod
    def packed(
        seq_lens: list[int],
        device: torch.device | str = "cpu",
        *,
        num_seqs: int | None = None,
        width: int | None = None,
    ) -> AttentionBatch:
        """Whole sequences packed back to back (training): sequence b occupies rows offset_b .. offset_b+len_b.

        num_seqs and width give the batch a fixed geometry (a CUDA-graph bucket): empty sequences are appended up
        to num_seqs, and every sequence is described as up to `width` long (a multiple of BLOCK_N, at least the
        longest), so the kernels' grids depend on the bucket only. Empty sequences own no rows and see no keys."""
        if not seq_lens or min(seq_lens) <= 0:
            raise ValueError(
                f"packed attention needs at least one sequence and positive lengths, got {seq_lens}"
            )
        if num_seqs is not None and num_seqs < len(seq_lens):
            raise ValueError(f"num_seqs {num_seqs} is less than the {len(seq_lens)} sequences given")
        max_len = max(seq_lens)
        if width is not None and (width < max_len or width % BLOCK_N):
            raise ValueError(
                f"width {width} must be a multiple of {BLOCK_N} and at least the longest sequence ({max_len})"
            )
        lens = torch.tensor(list(seq_lens) + [0] * ((num_seqs or 0) - len(seq_lens)), dtype=torch.int64)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        q_seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        q_pos = torch.arange(int(cu[-1])) - cu[:-1][q_seq]
        if width is None:
            width = _round_up(max_len, BLOCK_N)
        else:
            max_len = width
        n = torch.arange(width)
        key_slots = torch.where(
            n[None, :] < lens[:, None], cu[:-1, None] + n[None, :], torch.zeros(()).long()
        )
        return AttentionBatch(
            q_seq=q_seq.to(device),
            q_pos=q_pos.to(device),
            cu_seqlens_q=cu.to(device),
            key_lens=lens.to(device),
            key_slots=key_slots.to(device),
            max_seqlen_q=max_len,
            max_key_len=max_len,
        )

    @staticmethod
    def paged(
        num_cached: list[int],
        num_new: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionBatch:
        """A step against the paged cache: sequence b already has num_cached[b] tokens in the cache and brings
        num_new[b] new rows (a prefill chunk, or 1 for decode). Its keys after the step are 0 .. cached+new-1."""
        if block_size % BLOCK_N:
            raise ValueError(f"KV block_size {block_size} must be a multiple of the attention tile {BLOCK_N}")
        if not (len(num_cached) == len(num_new) == len(block_tables)) or not num_new:
            raise ValueError("paged attention needs one (num_cached, num_new, block_table) per sequence")
        cached = np.asarray(num_cached, dtype=np.int64)
        new = np.asarray(num_new, dtype=np.int64)
        if int(new.min()) <= 0:
            raise ValueError(f"every sequence in a step needs at least one new token, got {num_new}")
        key_lens = cached + new
        nseq = len(num_new)
        cu = np.zeros(nseq + 1, dtype=np.int64)
        np.cumsum(new, out=cu[1:])
        q_seq = np.repeat(np.arange(nseq, dtype=np.int64), new)
        q_pos = cached[q_seq] + np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][q_seq]
        max_blocks = max(len(t) for t in block_tables)
        for b, (t, n) in enumerate(zip(block_tables, key_lens.tolist())):
            if len(t) * block_size < n:
                raise ValueError(
                    f"sequence {b} needs {-(-n // block_size)} KV blocks for {n} tokens, has {len(t)}"
                )
        tables = np.zeros((nseq, max_blocks), dtype=np.int64)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = t
        max_key = int(key_lens.max())
        width = _round_up(max_key, BLOCK_N)
        n = np.arange(width, dtype=np.int64)
        blk = tables[:, np.minimum(n // block_size, max_blocks - 1)]
        key_slots = np.where(n[None, :] < key_lens[:, None], blk * block_size + n % block_size, 0)
        slot_mapping = tables[q_seq, q_pos // block_size] * block_size + q_pos % block_size
        q_seq_d, q_pos_d, cu_d, key_lens_d, key_slots_d, slot_mapping_d, tables_d = upload_int64(
            [q_seq, q_pos, cu, key_lens, key_slots, slot_mapping, tables], device
        )
        return AttentionBatch(
            q_seq=q_seq_d,
            q_pos=q_pos_d,
            cu_seqlens_q=cu_d,
            key_lens=key_lens_d,
            key_slots=key_slots_d,
            max_seqlen_q=int(new.max()),
            max_key_len=max_key,
            slot_mapping=slot_mapping_d,
            block_tables=tables_d.to(torch.int32),
            block_size=block_size,
        )


def upload_int64(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """int64 arrays -> tensors of the same shapes on `device`, through one host buffer and one copy.

    On CUDA the buffer is pinned and the copy asynchronous (queued on the current stream; PyTorch's pinned
    allocator keeps the buffer until it is done), so the host does not wait for the GPU to drain. Each array
    starts at a multiple of 16 elements, as aligned as a fresh allocation."""
    device = torch.device(device)
    sizes = [int(a.size) for a in arrays]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 16) * 16
    host = torch.empty(total, dtype=torch.int64, pin_memory=device.type == "cuda")
    h = host.numpy()
    for a, o, n in zip(arrays, offsets, sizes):
        h[o : o + n] = a.reshape(-1)
    if device.type == "cpu":
        flat = host
    else:
        flat = host.to(device, non_blocking=True)
    return [flat[o : o + n].view(a.shape) for a, o, n in zip(arrays, offsets, sizes)]


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)
