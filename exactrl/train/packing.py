"""Packing sequences into microbatches by a token budget, and the trainer's logprob computation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from exactrl.model.qwen import CausalLM
from exactrl.ops import AttentionBatch


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Split sequence indices, in order, into microbatches of at most `max_tokens` tokens (a longer sequence
    gets a microbatch of its own)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be positive, got {max_tokens}")
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


@dataclass
class PackedBatch:
    """Sequences packed for one forward: inputs are each sequence without its last token, targets the
    sequence shifted by one; `response_mask` marks targets that are completion tokens.

    input_ids, targets, positions: [T] int64; response_mask: [T] bool; seq_index: [T] int64 (which sequence);
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor
    seq_index: torch.Tensor
    batch: AttentionBatch
    seq_lens: list[int]

    @staticmethod
    def build(
        seqs: list[list[int]], prompt_lens: list[int], device: torch.device | str = "cpu"
    ) -> PackedBatch:
        ids, tgt, mask, sidx, lens = [], [], [], [], []
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            if len(s) < 2 or not 1 <= p < len(s) + 1:
                raise ValueError(
                    f"sequence {i}: needs >= 2 tokens and 1 <= prompt_len <= len, got len {len(s)}, prompt {p}"
                )
            n = len(s) - 1
            ids += s[:-1]
            tgt += s[1:]
            mask += [j >= p - 1 for j in range(n)]  # target j is token j+1: a completion token iff j+1 >= p
            sidx += [i] * n
            lens.append(n)
        dev = torch.device(device)
        return PackedBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            targets=torch.tensor(tgt, dtype=torch.int64, device=dev),
            response_mask=torch.tensor(mask, dtype=torch.bool, device=dev),
            seq_index=torch.tensor(sidx, dtype=torch.int64, device=dev),
            batch=AttentionBatch.packed(lens, device=dev),
            seq_lens=lens,
        )


def packed_microbatches(
    seqs: list[list[int]], prompt_lens: list[int], max_tokens: int, device: torch.device | str
) -> Iterator[tuple[list[int], PackedBatch]]:
    """(indices into seqs, their PackedBatch) for each microbatch of at most max_tokens tokens, in order."""
    for mb in pack_by_tokens([len(s) - 1 for s in seqs], max_tokens):
        yield mb, PackedBatch.build([seqs[i] for i in mb], [prompt_lens[i] for i in mb], device)


def response_logprobs(
    model: CausalLM, pb: PackedBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Logprobs (and entropy) of the completion targets of a packed batch: ([R], [R] or None, seq index [R]).

    Only completion rows go through the LM head: rows are independent, so the values are the same bits."""
    h = model(pb.input_ids, pb.batch.q_pos, pb.batch)
    rows = pb.response_mask.nonzero()[:, 0]
    lp, ent = model.logprobs(h[rows], pb.targets[rows], temperature, with_entropy)
    return lp, ent, pb.seq_index[rows]


def completion_logprobs(
    model: CausalLM,
    seqs: list[list[int]],
    prompt_lens: list[int],
    temperature: float = 1.0,
    max_tokens_per_microbatch: int = 8192,
) -> list[torch.Tensor]:
    """The trainer's logprobs of every completion token (no grad): one [len - prompt_len] fp32 tensor per
    sequence, through packed microbatches of the shared model."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with torch.no_grad():
        for mb, pb in packed_microbatches(seqs, prompt_lens, max_tokens_per_microbatch, model.device):
            lp, _, sidx = response_logprobs(model, pb, temperature)
            for j, i in enumerate(mb):
                out[i] = lp[sidx == j].float().cpu()
    return out  # type: ignore[return-value]
