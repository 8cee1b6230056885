"""The op interface every backend implements. The model calls only these, so the rollout engine and the trainer
run the same arithmetic by construction; a backend is chosen once per model (`get_ops`)."""

from __future__ import annotations

from typing import Protocol

import torch

from exactrl.ops.batch import AttentionBatch


class Ops(Protocol):
    """Batch-invariant (or, for the fast backend, default) implementations of the model's ops.

    `exact` backends promise: a row's result does not depend on how many other rows are in the call, where the row
    sits in it, how a sequence was chunked, or whether its keys came from the KV cache.
    """

    name: str
    exact: bool

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K], weight: [N, K], bias: [N] -> [T, N] in x.dtype (fp32 accumulation)."""
        ...

    def packed_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        """x: [T, K], weight: [sum(sizes), K] (projections of one input stacked, e.g. q/k/v) -> one [T, size]
        output per part, each with the bits of `linear(x, weight_part, bias_part)` on the exact backends."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., D] -> [..., D]; normalise in fp32, cast to x.dtype, multiply by weight (HF order)."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [..., D] of one dtype -> (normed, summed): summed = x + residual rounded once to x.dtype
        (torch's `x + residual`), normed = rms_norm(summed, weight, eps) with exactly those bits.

        The decoder's residual add and the next norm in one op; a backend may fuse them into one pass."""
        ...

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, Dh], positions: [T] int64, cos_sin: [P, Dh] fp32 (cos in the first half, sin in the second)."""
        ...

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, H, Dh] -> rope(rms_norm(x, weight, eps), positions, cos_sin) with exactly those bits (Qwen3's
        per-head q/k norm before RoPE); a backend may fuse the two into one pass."""
        ...

    def qk_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, Dh], k, v: [T, Hkv, Dh] -> (rms_norm_rope(q, q_weight, ...), rms_norm_rope(k, k_weight, ...))
        with exactly those bits: both halves of Qwen3's attention input. With kv_cache (this layer's (k_cache,
        v_cache), each [num_blocks, block_size, Hkv, Dh]) it also writes the finished K rows and v at slot_mapping
        [T], as `attention` would; then call `attention(..., kv_written=True)`. Differentiable in q, k and the
        weights (without a cache). A backend may do it all in one launch (a decode step is bound by launches)."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [T, I] -> silu(gate) * up, [T, I]."""
        ...

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """x: [...] -> sigmoid(x) in x.dtype (computed in fp32); exact backends: an element's bits never depend on
        the tensor's length or its place in it (Qwen2-MoE's shared-expert gate)."""
        ...

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] router output of `linear` (model dtype) -> (weights [T, k] fp32, ids [T, k] int64).

        probs = softmax(logits.float(), -1); the k largest probabilities in descending order, ties broken towards
        the lowest expert id; with norm_topk_prob the k weights are divided by their fp32 sum (summed in rank
        order). Row-local: a row's result never depends on other rows. Differentiable w.r.t. logits (through the
        weights)."""
        ...

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, D] model dtype; gate_up: [E, 2*I, D] (expert e's gate rows, then its up rows); down: [E, D, I];
        weights: [T, k] fp32; ids: [T, k] int64 -> [T, D] in x.dtype.

        For token t and rank r (e = ids[t, r]): g, u = the two halves of x_t @ gate_up[e]^T (model dtype, fp32
        accumulation), h = silu_mul(g, u), o_r = h @ down[e]^T (model dtype, fp32 accumulation);
        out_t = (sum over r = 0..k-1 in rank order of weights[t, r] * o_r.float(), in fp32).to(x.dtype).
        Exact backends: every row's bits are independent of how many tokens each expert received, of where the
        row sits in its expert's group and of the other rows in the call (the dense `linear` rule, applied per
        expert). Differentiable w.r.t. x, gate_up, down and weights; the exact backends' backward is
        deterministic."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """Causal attention. q: [T, Hq, Dh], k/v: [T, Hkv, Dh] -> [T, Hq, Dh].

        kv_cache: None for packed whole sequences (training), or this layer's (k_cache, v_cache), each
        [num_blocks, block_size, Hkv, Dh]; the new rows are written at batch.slot_mapping before attending, unless
        kv_written says `qk_norm_rope` already wrote them there (then k and v are not read).
        """
        ...

    def logprobs(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [T, D], weight: [V, D], targets: [T] int64 -> (logprobs [T] fp32, entropy [T] fp32 or None).

        log_softmax(linear(hidden, weight).float() / temperature)[targets], chunked over rows so [T, V] fp32
        logits never exist whole; differentiable with respect to hidden and weight.
        """
        ...

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """hidden: [T, D] -> [T, V] fp32 `linear(hidden, weight).float() / temperature`: the sampler's view of
        exactly the numbers `logprobs` normalises."""
        ...

    def scale_logits(self, raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """raw: [R, V] LM-head output from `linear` -> [R, V] fp32 raw / temperature: the numbers the sampler
        draws from, exactly the ones `logprobs_from_logits` normalises."""
        ...

    def logprobs_from_logits(
        self, raw: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """raw: [R, V] LM-head output from `linear` (model dtype, or fp32 with fp32_lm_head), targets: [R] ->
        [R] fp32. Bitwise equal to `logprobs(hidden, weight, targets, temperature)` when raw is
        `linear(hidden, weight)`: the engine records its logprobs without a second LM-head matmul."""
        ...
