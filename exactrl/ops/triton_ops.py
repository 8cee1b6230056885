"""`TritonOps`: the exact (batch-invariant) backend on CUDA, built from the Triton kernels in exactrl/ops/triton.

Every method runs the same compiled kernels for the rollout engine and the trainer, and each kernel's per-row
arithmetic is fixed independently of the batch (see each kernel module's docstring for the argument):

| op | kernel | invariance comes from |
| --- | --- | --- |
| linear | persistent GEMM, a tile family that keeps one K order | in-order K reduction, no split-K, M not specialised |
| rms_norm, add_rms_norm, rms_norm_rope, qk_norm_rope | a tile of rows per program, tile shape from D alone | one fixed-size reduction per row |
| rope, silu_mul, sigmoid | elementwise (sigmoid: torch's CUDA kernel) | nothing to reduce |
| attention | one kernel: training, prefill, decode (+ a combine kernel for split-KV decode) | keys from position 0 in ATTN_BLOCK_N tiles, masked tile = no-op, fixed ATTN_SPLIT_KEYS chunks folded in order |
| logprobs, logits | row-chunked GEMM + log-softmax in fixed vocabulary chunks (a program per row x chunk + a combine kernel) | fixed 8,192-column chunks folded in order, IEEE `/ temperature` |
| moe_route | one program per token: fp32 softmax, top-k | row-local, ties to the lowest expert id |
| moe_experts | device-side sort by expert, grouped GEMMs, rank-order combine | the dense GEMM's K chain per expert, tiles cut per expert, no routed count on the host |

Constraints for callers (the engine): tensors in bf16, fp16 or fp32 (one dtype per model); head dim any size
(padded to a power of two >= 16 inside the kernel); Hq a multiple of Hkv with Hq / Hkv <= 64; KV page size a
multiple of exactrl.ops.batch.BLOCK_N (16), as AttentionBatch already checks; TF32 off
(`set_exact_environment(True)`) for the torch matmuls in the backward; moe_experts' ids in 0..E-1 and distinct
within a token, as moe_route returns them (not checked: that would synchronise with the host).
"""

from __future__ import annotations

import torch

from exactrl.ops.batch import AttentionBatch
from exactrl.ops.triton.attention import ATTN_BLOCK_N, ATTN_ROWS, attention
from exactrl.ops.triton.elementwise import rope, silu_mul
from exactrl.ops.triton.logprobs import (
    LOGPROB_CHUNK_ROWS,
    logits,
    logprobs,
    logprobs_from_logits,
    scaled_logits,
)
from exactrl.ops.triton.matmul import MATMUL_CONFIGS, linear, packed_linear
from exactrl.ops.triton.moe import moe_experts, moe_route
from exactrl.ops.triton.norm import add_rms_norm, qk_norm_rope, rms_norm, rms_norm_rope

__all__ = ["ATTN_BLOCK_N", "ATTN_ROWS", "LOGPROB_CHUNK_ROWS", "MATMUL_CONFIGS", "TritonOps"]


class TritonOps:
    """Batch-invariant ops in Triton: the exact backend on CUDA (also runs under TRITON_INTERPRET=1 on the CPU)."""

    name = "exact-triton"
    exact = True
    attn_block_n = ATTN_BLOCK_N

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias)

    def packed_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        return packed_linear(x, weight, bias, sizes)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return rope(x, positions, cos_sin)

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        return rms_norm_rope(x, weight, eps, positions, cos_sin)

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
        return qk_norm_rope(q, k, v, q_weight, k_weight, eps, positions, cos_sin, kv_cache, slot_mapping)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        # CUDA's elementwise sigmoid applies one per-element functor (1 / (1 + exp(-x)) in fp32) to every element,
        # vectorised loads or not: nothing to reduce, no tail routine (tests/ops/test_sigmoid_gpu.py sweeps rows).
        return torch.sigmoid(x)

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
        return attention(q, k, v, batch, kv_cache, kv_written)

    def logprobs(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return logprobs(hidden, weight, targets, temperature, with_entropy)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return logits(hidden, weight, temperature)

    def scale_logits(self, raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return scaled_logits(raw, temperature)

    def logprobs_from_logits(
        self, raw: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        return logprobs_from_logits(raw.contiguous(), targets, temperature)[0]

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_route(logits, top_k, norm_topk_prob)

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts(x, gate_up, down, weights, ids)
