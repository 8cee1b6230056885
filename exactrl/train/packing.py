"""Packing sequences into microbatches by a token budget, and the trainer's logprob computation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from exactrl.model.qwen import CausalLM
from exactrl.ops import AttentionBatch
from exactrl.ops.batch import BLOCK_N


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


def masked_packed_batch(
    seqs: list[list[int]],
    prompt_lens: list[int],
    loss_masks: list[list[bool]],
    device: torch.device | str = "cpu",
) -> PackedBatch:
    """A PackedBatch whose response mask is a per-token mask: loss_masks[i] is aligned with the completion
    seqs[i][prompt_lens[i]:] (multi-turn episodes: True at sampled tokens, False at observation tokens)."""
    pb = PackedBatch.build(seqs, prompt_lens, device)
    mask: list[bool] = []
    for i, (s, p, m) in enumerate(zip(seqs, prompt_lens, loss_masks)):
        if len(m) != len(s) - p:
            raise ValueError(
                f"sequence {i}: loss mask has {len(m)} entries for {len(s) - p} completion tokens"
            )
        mask += [False] * (p - 1) + [bool(x) for x in m]  # target j is token j + 1
    pb.response_mask &= torch.tensor(mask, dtype=torch.bool, device=pb.response_mask.device)
    return pb


def masked_completion_logprobs(
    model: CausalLM,
    seqs: list[list[int]],
    prompt_lens: list[int],
    loss_masks: list[list[bool]],
    temperature: float = 1.0,
    max_tokens_per_microbatch: int = 8192,
) -> list[torch.Tensor]:
    """`completion_logprobs` under per-token loss masks: one [len - prompt_len] fp32 tensor per sequence, the
    trainer's logprob at masked-in tokens and 0.0 elsewhere (the layout of `Episode.rollout_logprobs`)."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with torch.no_grad():
        for mb in pack_by_tokens([len(s) - 1 for s in seqs], max_tokens_per_microbatch):
            pb = masked_packed_batch(
                [seqs[i] for i in mb], [prompt_lens[i] for i in mb], [loss_masks[i] for i in mb], model.device
            )
            lp, _, sidx = response_logprobs(model, pb, temperature)
            for j, i in enumerate(mb):
                full = torch.zeros(len(seqs[i]) - prompt_lens[i], dtype=torch.float32)
                full[torch.tensor(loss_masks[i], dtype=torch.bool)] = lp[sidx == j].float().cpu()
                out[i] = full
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------
# Padded microbatches for the captured training step (exactrl.train.graphs)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """The geometry of one training microbatch: what a CUDA graph of it is captured for.

    tokens: rows through the model; seqs: sequences in the attention batch (real ones, then padding sequences
    that hold the spare tokens, then empty ones); max_len: the longest sequence the attention kernels plan for
    (their grids depend on it); width: key_slots columns (max_len rounded up to the key tile); rows: rows
    through the LM head (the completion targets, then repeats of the last row); batch, cols: the padded
    [batch, cols] matrices the loss sees (one row per real sequence, one column per completion token).
    """

    tokens: int
    seqs: int
    max_len: int
    width: int
    rows: int
    batch: int
    cols: int


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def choose_bucket(
    seq_lens: list[int],
    completion_lens: list[int],
    *,
    max_tokens: int,
    max_positions: int,
    padded: bool,
) -> Bucket:
    """The bucket of a microbatch of sequences with these (input) lengths and completion lengths.

    padded=False: the exact fit (no padding at all; what the eager step uses). padded=True: a few sizes only,
    so that a handful of CUDA graphs serve a whole run: tokens = the microbatch budget (a multiple of it for a
    single longer sequence), lengths and counts rounded up to powers of two, LM-head rows to eighths of the
    budget."""
    n_tok, n_rows, longest = sum(seq_lens), sum(completion_lens), max(seq_lens)
    if not padded:
        return Bucket(
            tokens=n_tok,
            seqs=len(seq_lens),
            max_len=longest,
            width=_round_up(longest, BLOCK_N),
            rows=n_rows,
            batch=len(seq_lens),
            cols=max(completion_lens),
        )
    tokens = max_tokens * -(-n_tok // max_tokens)
    width = _round_up(longest, BLOCK_N)
    width = max(width, min(_pow2_at_least(longest, 64), tokens, max_positions // BLOCK_N * BLOCK_N))
    spare = tokens - n_tok
    seqs = _pow2_at_least(len(seq_lens) + -(-spare // width), 8)
    rows = min(tokens, _round_up(n_rows, max(BLOCK_N, tokens // 8)))
    longest_c = max(completion_lens)
    cols = max(longest_c, min(_pow2_at_least(longest_c, 64), width))
    return Bucket(
        tokens=tokens,
        seqs=seqs,
        max_len=width,
        width=width,
        rows=rows,
        batch=_pow2_at_least(len(seq_lens), 8),
        cols=cols,
    )


@dataclass
class TrainMicrobatch:
    """Sequences laid out for one captured (or eager) training microbatch, as CPU tensors of the bucket's shapes.

    inputs: input_ids, positions [tokens]; q_seq [tokens], cu_seqlens [seqs + 1], key_lens [seqs],
    key_slots [seqs, width] (the attention batch); row_index, row_targets [rows] (the LM-head rows and their
    targets); loss_index [batch, cols] (position of each completion token's logprob among the rows, `rows` for
    padding, where the loss reads an appended zero). `completion_lens`: of the real sequences, in order.
    """

    bucket: Bucket
    inputs: dict[str, torch.Tensor]
    completion_lens: list[int]

    @staticmethod
    def build(
        seqs: list[list[int]],
        prompt_lens: list[int],
        *,
        max_tokens: int,
        max_positions: int,
        padded: bool,
    ) -> TrainMicrobatch:
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            if len(s) < 2 or not 1 <= p < len(s):
                raise ValueError(
                    f"sequence {i}: needs a prompt of >= 1 token and >= 1 completion token, got len {len(s)}, "
                    f"prompt {p}"
                )
        lens = [len(s) - 1 for s in seqs]
        comp = [len(s) - p for s, p in zip(seqs, prompt_lens)]
        bk = choose_bucket(lens, comp, max_tokens=max_tokens, max_positions=max_positions, padded=padded)
        spare = bk.tokens - sum(lens)
        pad_lens = [min(bk.width, spare - k) for k in range(0, spare, bk.width)]
        batch = AttentionBatch.packed(lens + pad_lens, num_seqs=bk.seqs, width=bk.width)
        ids: list[int] = []
        tgt: list[int] = []
        rows: list[int] = []
        for s, p in zip(seqs, prompt_lens):
            rows += range(len(ids) + p - 1, len(ids) + len(s) - 1)  # input row j predicts token j + 1
            ids += s[:-1]
            tgt += s[1:]
        ids += [0] * spare  # padding tokens: their own sequences, never a loss row
        tgt += [0] * spare
        rows += [bk.tokens - 1] * (bk.rows - len(rows))
        loss_index = torch.full((bk.batch, bk.cols), bk.rows, dtype=torch.int64)
        off = 0
        for j, c in enumerate(comp):
            loss_index[j, :c] = torch.arange(off, off + c)
            off += c
        row_index = torch.tensor(rows, dtype=torch.int64)
        return TrainMicrobatch(
            bucket=bk,
            inputs={
                "input_ids": torch.tensor(ids, dtype=torch.int64),
                "positions": batch.q_pos,
                "q_seq": batch.q_seq,
                "cu_seqlens": batch.cu_seqlens_q,
                "key_lens": batch.key_lens,
                "key_slots": batch.key_slots,
                "row_index": row_index,
                "row_targets": torch.tensor(tgt, dtype=torch.int64)[row_index],
                "loss_index": loss_index,
            },
            completion_lens=comp,
        )


def microbatch_attention(x: dict[str, torch.Tensor], bucket: Bucket) -> AttentionBatch:
    """The AttentionBatch of a TrainMicrobatch's (device) inputs."""
    return AttentionBatch(
        q_seq=x["q_seq"],
        q_pos=x["positions"],
        cu_seqlens_q=x["cu_seqlens"],
        key_lens=x["key_lens"],
        key_slots=x["key_slots"],
        max_seqlen_q=bucket.max_len,
        max_key_len=bucket.max_len,
    )


def microbatch_logprobs(
    model: CausalLM, x: dict[str, torch.Tensor], bucket: Bucket, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each [batch, cols] fp32 with zeros at padding, of a TrainMicrobatch's completion
    tokens: the model over all rows, the LM head over the completion rows only."""
    h = model(x["input_ids"], x["positions"], microbatch_attention(x, bucket))
    lp, ent = model.logprobs(h[x["row_index"]], x["row_targets"], temperature, True)
    assert ent is not None
    zero = lp.new_zeros(1)
    idx = x["loss_index"]
    return torch.cat([lp, zero])[idx], torch.cat([ent, zero])[idx]
