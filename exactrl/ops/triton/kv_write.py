"""The paged KV-cache write of a prefill or decode step: each new row's K and V into its cache slot, in one launch.

`write_kv_cache` (exactrl/ops/torch_ops.py) does it with two `index_copy_` calls, one for K and one for V. On the
GPU a decode step of few sequences is bound by the number of kernels it launches, not by the bytes they move
(qwen3-0.6b at one sequence: 56 `index_copy_` launches a step of 2.2 us each, for 4 KB a layer; docs/benchmarks.md),
so the Triton backends write K and V together: one program per new row copies its [Hkv, Dh] K and V rows to the
slot. A copy: the cache holds the same bytes either way, so nothing here touches exactness. Qwen3's layers (q/k
norm) do this write inside `norm.qk_norm_rope`'s launch instead; this one serves the models without a q/k norm.

Rows that share a slot (the engine points every padding row of a decode bucket at one scratch slot) race, as they do
under `index_copy_`; the scratch slot's contents are never read by a real row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.torch_ops import kv_cache_views
from exactrl.ops.torch_ops import write_kv_cache as write_with_index_copy
from exactrl.ops.triton.common import next_pow2, pdl, pdl_wait


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < ROW
    tl.store(kc_ptr + slot * ROW + cols, tl.load(k_ptr + t * stride_k + cols, mask=ok), mask=ok)
    tl.store(vc_ptr + slot * ROW + cols, tl.load(v_ptr + t * stride_v + cols, mask=ok), mask=ok)


def _rows_ok(x: torch.Tensor) -> bool:
    """A [T, H, D] tensor whose heads of one token are contiguous (the packed q/k/v views are)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As exactrl.ops.torch_ops.write_kv_cache (the new rows into the paged cache, before attending; returns flat
    [slots, Hkv, Dh] views), in one launch. Falls back to it where a copy would also convert the dtype or the rows
    are laid out otherwise."""
    k_flat, v_flat = kv_cache_views(kv_cache)
    hkv, dh = k_flat.shape[1:]
    T = k.shape[0]
    same = k.dtype == v.dtype == k_flat.dtype == v_flat.dtype
    if not (same and k.shape == v.shape == (T, hkv, dh) and _rows_ok(k) and _rows_ok(v)):
        return write_with_index_copy(k, v, kv_cache, slot_mapping)
    if T:
        row = hkv * dh
        _kv_write_kernel[(T,)](
            k, v, k_flat, v_flat, slot_mapping.contiguous(), k.stride(0), v.stride(0),
            ROW=row, BLOCK=next_pow2(row), num_warps=4,
            **pdl(k.device),
        )  # fmt: skip
    return k_flat, v_flat
