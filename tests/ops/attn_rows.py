"""Decode rows over a packed training batch's key store, for the attention tests (interpreter and GPU)."""

from __future__ import annotations

import torch

from exactrl.ops.batch import AttentionBatch


def decode_rows(lens: list[int], picks: list[int], device) -> tuple[torch.Tensor, AttentionBatch]:
    """Packed rows of position p of every sequence long enough, for each p in picks, as one decode step (one query
    per sequence entry) over the packed key store."""
    train = AttentionBatch.packed(lens, device=device)
    seq, pos, rows, start = [], [], [], 0
    for b, n in enumerate(lens):
        for p in picks:
            if p < n:
                seq.append(b)
                pos.append(p)
                rows.append(start + p)
        start += n
    seq_t = torch.tensor(seq, device=device)
    pos_t = torch.tensor(pos, device=device)
    batch = AttentionBatch(
        q_seq=torch.arange(len(seq), device=device),
        q_pos=pos_t,
        cu_seqlens_q=torch.arange(len(seq) + 1, device=device),
        key_lens=pos_t + 1,
        key_slots=train.key_slots[seq_t],
        max_seqlen_q=1,
        max_key_len=max(lens),
    )
    return torch.tensor(rows, device=device), batch
