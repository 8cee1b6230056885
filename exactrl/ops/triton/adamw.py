"""AdamW over fp32 master weights in one launch for all parameters, reading 16-bit gradients, writing 16-bit weights.

torch's fused AdamW wants gradients in the masters' dtype, so a bf16 model pays for an fp32 copy of every
gradient before the step and a copy of every master back into the bf16 weights after it: about 7 GB of extra
memory traffic per step at 0.6B parameters. This kernel reads each bf16 gradient once, updates the fp32 master,
exp_avg and exp_avg_sq in place, and writes the bf16 weight, with the arithmetic of torch's fused AdamW (fp32,
decoupled weight decay, bias corrections from the step count).

One launch serves every parameter: a table maps each program to (tensor, first element), and per-tensor
addresses are read from int64 tables (the grouped-GEMM pattern), so the launch count does not grow with the
number of parameters. Elementwise and in place: deterministic, and the same for any grouping of tensors.

Step-dependent values come from a device tensor (`scalars`), so a step that the device decides to skip (a
non-finite gradient norm) needs no host read: the kernel leaves weights and moments alone when `scalars[3]` is 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import pdl, pdl_wait

# Elements a program updates, and its warps: 1,024 and 4 (8 elements a thread) moved 2.93 TB/s on an H100 over
# qwen3-1.7b's parameters against 2.53 TB/s at 2,048 and far less at 4,096 or more (benchmarks/probe_adamw.py,
# docs/benchmarks.md). The launch shape only: an element's arithmetic is the same in each.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _adamw_kernel(
    blk_tensor, blk_start, numels, p32_ptrs, g_ptrs, m_ptrs, v_ptrs, p16_ptrs, scalars,
    lr, beta1, beta2, eps, weight_decay,
    G_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    skip = tl.load(scalars + 3)
    if skip != 0.0:
        return
    t = tl.load(blk_tensor + pid)
    start = tl.load(blk_start + pid).to(tl.int64)
    n = tl.load(numels + t)
    idx = start + tl.arange(0, BLOCK)
    ok = idx < n
    p32 = tl.load(p32_ptrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    p16 = tl.load(p16_ptrs + t).to(tl.pointer_type(P_DTYPE))
    grad_scale = tl.load(scalars)
    bc1 = tl.load(scalars + 1)
    bc2_sqrt = tl.sqrt_rn(tl.load(scalars + 2))
    g = tl.load(g_ptr + idx, mask=ok, other=0.0).to(tl.float32) / grad_scale
    p = tl.load(p32 + idx, mask=ok, other=0.0)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0)
    v = tl.load(v_ptr + idx, mask=ok, other=0.0)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v) / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    tl.store(m_ptr + idx, m, mask=ok)
    tl.store(v_ptr + idx, v, mask=ok)
    tl.store(p32 + idx, p, mask=ok)
    tl.store(p16 + idx, p.to(P_DTYPE), mask=ok)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class AdamWTables:
    """The launch tables of one set of (master, grad, exp_avg, exp_avg_sq, weight) tensors. The block tables
    depend on the sizes only and are built once; the address tables are rebuilt by `point_at` when a tensor
    moves (gradients that autograd allocates afresh every step)."""

    def __init__(
        self, numels: list[int], device: torch.device, block: int = BLOCK, num_warps: int = NUM_WARPS
    ):
        if not numels:
            raise ValueError("AdamWTables: no parameters")
        # The launch shape only: the per-element arithmetic is fixed.
        self.block, self.num_warps = block, num_warps
        blk_t: list[int] = []
        blk_s: list[int] = []
        for i, n in enumerate(numels):
            k = -(-n // block)
            blk_t += [i] * k
            blk_s += range(0, k * block, block)
        self.numels = list(numels)
        self.num_blocks = len(blk_t)
        self.device = device
        self.blocks = [
            torch.tensor(blk_t, dtype=torch.int32).to(device),
            torch.tensor(blk_s, dtype=torch.int64).to(device),
            torch.tensor(numels, dtype=torch.int64).to(device),
        ]
        self.pointers: list[torch.Tensor] = []
        self.addresses: tuple[int, ...] = ()
        self.g_dtype = self.w_dtype = torch.float32

    def point_at(
        self,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        weights: list[torch.Tensor],
    ) -> None:
        """Point the tables at these tensors (one of each per parameter, in the order of `numels`)."""
        groups = (masters, grads, exp_avgs, exp_avg_sqs, weights)
        addresses = tuple(t.data_ptr() for x in groups for t in x)
        if addresses == self.addresses:
            return
        if any(len(x) != len(self.numels) for x in groups):
            raise ValueError("AdamWTables: one master, grad, exp_avg, exp_avg_sq and weight per parameter")
        for i, (n, p, g, m, v, w) in enumerate(zip(self.numels, *groups)):
            if not (p.dtype == m.dtype == v.dtype == torch.float32):
                raise ValueError(f"parameter {i}: masters and moments must be float32")
            if not (n == p.numel() == g.numel() == m.numel() == v.numel() == w.numel()):
                raise ValueError(f"parameter {i}: tensors of different sizes")
            if not all(x.is_contiguous() and x.device == self.device for x in (p, g, m, v, w)):
                raise ValueError(f"parameter {i}: tensors must be contiguous and on {self.device}")
        g_dtypes, w_dtypes = {g.dtype for g in grads}, {w.dtype for w in weights}
        if len(g_dtypes) != 1 or len(w_dtypes) != 1:
            raise ValueError("AdamWTables: all gradients (and all weights) must share one dtype")
        self.g_dtype, self.w_dtype = g_dtypes.pop(), w_dtypes.pop()
        table = torch.tensor(addresses, dtype=torch.int64).view(5, -1).to(self.device)
        self.pointers = list(table.unbind(0))
        self.addresses = addresses


def adamw_step(
    tables: AdamWTables,
    scalars: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over every parameter of `tables`. scalars: float32 [4] on the device = (the divisor of the
    gradients (the clip), 1 - beta1**step, 1 - beta2**step, skip flag: 1 leaves everything untouched)."""
    if scalars.dtype != torch.float32 or scalars.numel() != 4:
        raise ValueError("scalars must be a float32 tensor of 4 values")
    if not tables.pointers:
        raise ValueError("AdamWTables.point_at must be called before the first step")
    _adamw_kernel[(tables.num_blocks,)](
        *tables.blocks, *tables.pointers, scalars, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        G_DTYPE=_TL[tables.g_dtype], P_DTYPE=_TL[tables.w_dtype], BLOCK=tables.block, num_warps=tables.num_warps,
        **pdl(scalars.device),
    )  # fmt: skip
