"""Fused Gumbel-max sampling: `gumbel_argmax` equals `exactrl.engine.sampler.sample` bit for bit (no top-k/top-p).

One program per row walks the vocabulary in fixed BLOCK_V slices. For every element it recomputes the noise
G(key, v) of `sampler.gumbel_noise`, forms y = logits + G in fp32 and keeps a running (max, lowest index) per
lane; one lane reduction at the end picks the row's token. Greedy rows take the argmax of the logits alone.

Why the bits are the same as the torch version:

* Hash. `_mix32` works on uint32: a wrapping 32-bit multiply is (x * c) mod 2**32, the `& 0xFFFFFFFF` of the
  int64 torch code, and `>>` on unsigned ints is a logical shift. Both are exact integer ops everywhere.
* Uniform. u = (float(h >> 9) + 0.5) * 2**-23: the same two fp32 operations, both exact (24 significant bits),
  so u lies in [2**-24, 1 - 2**-24] and both logarithms see positive normal floats.
* Log. `_log` repeats the torch `_log` operation by operation in fp32: frexp from the bit pattern (inputs are
  positive normal floats or +-0, where frexp gives (x, 0)), the `m < sqrt(0.5)` test against the fp32-rounded
  constant (what torch compares with for an fp32 tensor), s = (m - 1) / (m + 1) with IEEE division (`div_rn`,
  correctly rounded; Triton's `/` is approximate on the GPU), the polynomial as separate multiply and add, then
  e * LN2 + (s * p) * 2. Every constant is the fp32-rounded python constant, as torch uses for fp32 tensors.
  Contracting a multiply and an add into one FMA would round once instead of twice, so the kernels are compiled
  with `enable_fp_fusion=False` (no FMA contraction, LLVM and ptxas --fmad=false).
* Argmax. A lane sees its indices in increasing order and replaces its best only on a strictly larger value, so
  it keeps the lowest index of its maximum; the final reduction takes the lowest index among lanes holding the
  row maximum. NaN counts as larger than everything (as in torch.argmax): the first NaN wins. Comparisons and
  selects are exact, so the result does not depend on BLOCK_V.

The noise alone is available as `gumbel_noise_triton` (tests compare it with `gumbel_noise` bit for bit).
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import INTERPRET, num_programs_cap, pdl, pdl_wait

_BLOCK_V = 8192 if INTERPRET else 2048  # vocabulary slice per loop step (any size gives the same tokens)
_NOISE_BLOCK = 1 << 16 if INTERPRET else 2048
_NO_INDEX = 2**31 - 1  # a lane that has seen no element yet
_NO_INDEX_K = tl.constexpr(_NO_INDEX)  # the same, readable inside kernels
# No FMA contraction: the torch reference rounds after every multiply and every add (see the docstring). The
# interpreter computes op by op with numpy anyway (and has no such option).
_LAUNCH_OPTS = {} if INTERPRET else {"enable_fp_fusion": False}


def _f32(x: float) -> float:
    """x rounded to the nearest fp32 (ties to even), as torch rounds a python scalar for an fp32 tensor."""
    return struct.unpack("f", struct.pack("f", x))[0]


# The constants of sampler._log / sampler.gumbel_noise, fp32-rounded (exact in fp32, so Triton keeps them as is).
_SQRT_HALF = tl.constexpr(_f32(math.sqrt(0.5)))
_LN2 = tl.constexpr(_f32(math.log(2.0)))
_C1 = tl.constexpr(1.0)
_C3 = tl.constexpr(_f32(1.0 / 3))
_C5 = tl.constexpr(_f32(1.0 / 5))
_C7 = tl.constexpr(_f32(1.0 / 7))
_C9 = tl.constexpr(_f32(1.0 / 9))
_C11 = tl.constexpr(_f32(1.0 / 11))
_TWO_M23 = tl.constexpr(2.0**-23)


@triton.jit
def _mix32(x):
    """sampler._mix32 on uint32 (wrapping multiply == product & 0xFFFFFFFF; logical shifts)."""
    tl.static_assert(x.dtype == tl.uint32)
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x21F0AAAD, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x735A2D97, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _row_seeds(key):
    """(s1, s2) of gumbel_noise for one int64 key >= 0."""
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = (key >> 32).to(tl.uint32)  # key < 2**63: fits
    s1 = _mix32(lo ^ tl.full([], 0x68E31DA4, tl.uint32))
    s2 = _mix32(hi ^ _mix32(s1 ^ tl.full([], 0xB5297A4D, tl.uint32)))
    return s1, s2


@triton.jit
def _absorb(a, b, v):
    """One input of sampler._key: its low then high 32-bit word into the (a, b) state."""
    lo = (v & 0xFFFFFFFF).to(tl.uint32)
    a = _mix32(a ^ lo)
    b = _mix32(b ^ _mix32(lo ^ tl.full([], 0x9E3779B9, tl.uint32)))
    hi = (v >> 32).to(tl.uint32)  # v < 2**63: fits
    a = _mix32(a ^ hi)
    b = _mix32(b ^ _mix32(hi ^ tl.full([], 0x9E3779B9, tl.uint32)))
    return a, b


@triton.jit
def _row_seeds_from_parts(parts_ptr, stride_p, row):
    """(s1, s2) of the key sampler.noise_key(seed, request_id, sample_index, position) of one row, computed from
    the four int64 inputs (rows 0..3 of `parts`): the key's low word is b, its high word a & 0x3FFFFFFF."""
    a = tl.full([], 0x243F6A88, tl.uint32)
    b = tl.full([], 0x85A308D3, tl.uint32)
    for i in tl.static_range(4):
        a, b = _absorb(a, b, tl.load(parts_ptr + i * stride_p + row))
    s1 = _mix32(b ^ tl.full([], 0x68E31DA4, tl.uint32))
    s2 = _mix32((a & tl.full([], 0x3FFFFFFF, tl.uint32)) ^ _mix32(s1 ^ tl.full([], 0xB5297A4D, tl.uint32)))
    return s1, s2


@triton.jit
def _log(x):
    """sampler._log for fp32 x > 0 (normal) or x == +-0, operation by operation."""
    bits = x.to(tl.int32, bitcast=True)
    is_zero = x == 0.0
    # frexp: x = m * 2**e, m in [0.5, 1); frexp(+-0) = (+-0, 0)
    m = tl.where(is_zero, x, ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True))
    e = tl.where(is_zero, 0, ((bits >> 23) & 0xFF) - 126)
    small = m < _SQRT_HALF
    m = tl.where(small, m * 2.0, m)
    ef = e.to(tl.float32) - small.to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    z = s * s
    p = tl.full(z.shape, _C11, tl.float32)
    p = p * z + _C9
    p = p * z + _C7
    p = p * z + _C5
    p = p * z + _C3
    p = p * z + _C1
    return ef * _LN2 + (s * p) * 2.0


@triton.jit
def _gumbel(h):
    """G from the uint32 hash h: u = ((h >> 9) + 0.5) * 2**-23, G = -log(-log(u))."""
    u = ((h >> 9).to(tl.int32).to(tl.float32) + 0.5) * _TWO_M23
    return -_log(-_log(u))


@triton.jit
def _noise(cols, s1, s2):
    """gumbel_noise(key)[cols] for one row's (s1, s2); cols int32 >= 0."""
    v = _mix32(cols.to(tl.uint32) ^ tl.full([], 0x1B56C4E9, tl.uint32))
    return _gumbel(_mix32(_mix32(v ^ s1) ^ s2))


@triton.jit(do_not_specialize=["V", "chunk"])
def _gumbel_argmax_kernel(
    x_ptr, keys_ptr, greedy_ptr, out_ptr, part_val_ptr, stride_x, stride_p, V, chunk, temperature,
    HAS_GREEDY: tl.constexpr, KEY_PARTS: tl.constexpr, BLOCK_V: tl.constexpr, SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # SPLIT: program (row, s) covers the columns [s * chunk, (s + 1) * chunk) of its row and stores its
    # candidate (value, index) at [row, s] of part_val / out for `_argmax_combine_kernel`; else one program
    # per row covers all V columns (chunk unused) and stores the token.
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    start = 0
    stop = V
    if SPLIT:
        start = tl.program_id(1) * chunk
        stop = tl.minimum(start + chunk, V)
    if KEY_PARTS:
        s1, s2 = _row_seeds_from_parts(keys_ptr, stride_p, row)
    else:
        s1, s2 = _row_seeds(tl.load(keys_ptr + row))
    add_noise = True
    if HAS_GREEDY:
        add_noise = tl.load(greedy_ptr + row) == 0
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_V], _NO_INDEX_K, tl.int32)
    for v0 in range(start, stop, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < stop
        y = tl.load(base + cols, mask=ok, other=0.0)
        if SCALE:  # raw logits: z = logits.float() / T as `scaled_logits` computes it (IEEE division)
            y = tl.math.div_rn(y.to(tl.float32), temperature)
        if add_noise:
            y = y + _noise(cols, s1, s2)
        # strictly larger (lanes see increasing indices: keeps the lowest), the lane's first element, or the
        # first NaN (torch.argmax treats NaN as the maximum)
        take = ok & ((y > best) | (best_i == _NO_INDEX_K) | ((y != y) & (best == best)))
        best = tl.where(take, y, best)
        best_i = tl.where(take, cols, best_i)
    seen = best_i != _NO_INDEX_K
    nan = seen & (best != best)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    mx = tl.max(tl.where(seen & ~nan, best, float("-inf")), axis=0)
    hit = tl.where(any_nan, nan, seen & (best == mx))
    token = tl.min(tl.where(hit, best_i, _NO_INDEX_K), axis=0)
    if SPLIT:
        at = row * tl.num_programs(1) + tl.program_id(1)
        tl.store(part_val_ptr + at, tl.where(any_nan, float("nan"), mx))
        tl.store(out_ptr + at, token.to(tl.int64))
    else:
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _argmax_combine_kernel(
    part_val_ptr, part_idx_ptr, out_ptr, S, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)
    # One row's S candidates from the split `_gumbel_argmax_kernel`, reduced by the rule every lane and the
    # single-program kernel follow: the first NaN if any, else the lowest index holding the maximum. Each
    # candidate is its slice's answer under that rule, and the slices cover the row in order, so this is the
    # row's answer: the same token whatever the split.
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_S)
    ok = k < S
    val = tl.load(part_val_ptr + row * S + k, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * S + k, mask=ok, other=_NO_INDEX_K)
    seen = ok & (idx != _NO_INDEX_K)
    nan = seen & (val != val)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    mx = tl.max(tl.where(seen & ~nan, val, float("-inf")), axis=0)
    hit = tl.where(any_nan, nan, seen & (val == mx))
    tl.store(out_ptr + row, tl.min(tl.where(hit, idx, _NO_INDEX_K), axis=0))


@triton.jit(do_not_specialize=["V"])
def _gumbel_noise_kernel(keys_ptr, out_ptr, stride_o, V, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s1, s2 = _row_seeds(tl.load(keys_ptr + row))
    tl.store(out_ptr + row * stride_o + cols, _noise(cols, s1, s2), mask=cols < V)


@triton.jit(do_not_specialize=["n"])
def _gumbel_of_uniform_kernel(out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + idx, _gumbel(idx.to(tl.uint32) << 9), mask=idx < n)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------
def fused_sampling_supported(logits: torch.Tensor) -> bool:
    """Whether gumbel_argmax can take these logits: 2-D fp32 on a CUDA device (any device when interpreting)."""
    return (
        isinstance(logits, torch.Tensor)
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and (logits.is_cuda or INTERPRET)
    )


def _check_device(t: torch.Tensor, what: str) -> None:
    if not (t.is_cuda or INTERPRET):
        raise ValueError(f"{what}: the kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def _check_keys(keys: torch.Tensor, rows: int, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(keys, torch.Tensor) or keys.shape != (rows,):
        shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"{what}: keys must be a tensor of shape [{rows}] (one key per row), got {shape}")
    if keys.dtype != torch.int64:
        raise ValueError(f"{what}: keys must be int64, got {keys.dtype}")
    if keys.device != device:
        raise ValueError(f"{what}: keys are on {keys.device}, the logits on {device}")
    if bool((keys < 0).any()):
        raise ValueError(f"{what}: keys must be non-negative int64")
    return keys.contiguous()


# Programs a sampling call aims for per SM. The noise costs a hash and two logarithms a column, so one program per
# row at 256 rows (two per SM) left the SMs short of warps: 334 -> 215 us at 256 rows with 8 (H200,
# benchmarks/probe_sampler.py), at a small cost where 2 already split the rows (16 rows 20.0 -> 20.5 us, 64 rows
# 61.5 -> 64.2).
_PROGRAMS_PER_SM = 8


def _vocab_split(rows: int, vocab: int, block: int, device: torch.device) -> tuple[int, int]:
    """(slices per row, columns per slice) of a gumbel_argmax call. A few rows (a decode step at low
    concurrency) would leave all but a few SMs idle while one program per row walks the whole vocabulary, so
    each row is cut into slices of whole `block`s until about _PROGRAMS_PER_SM programs per SM are busy; from
    that many rows on, one program per row. The split only decides who looks at which columns: the token is the
    same (`_argmax_combine_kernel`)."""
    want = _PROGRAMS_PER_SM * num_programs_cap(device)
    if rows >= want:
        return 1, vocab
    blocks = triton.cdiv(vocab, block)
    per_row = max(1, min(blocks, want // rows))
    chunk = triton.cdiv(blocks, per_row) * block
    return triton.cdiv(vocab, chunk), chunk


def gumbel_argmax(
    logits: torch.Tensor,
    keys: torch.Tensor | None,
    greedy: torch.Tensor | None = None,
    *,
    key_parts: torch.Tensor | None = None,
    block_v: int | None = None,
    temperature: float | None = None,
) -> torch.Tensor:
    """logits: float32 [R, V] (already divided by temperature), keys: int64 [R] >= 0, greedy: bool [R] or None
    -> int64 [R]; equal to sampler.sample(logits, keys, greedy=greedy) bit for bit.

    temperature (instead of pre-scaled logits): the raw LM-head logits in their own dtype (bf16, fp16 or fp32),
    divided by `temperature` in the kernel exactly as `scaled_logits` divides them: the same tokens as
    gumbel_argmax(scaled_logits(logits, temperature), ...), without writing and re-reading fp32 logits.

    key_parts (instead of keys): int64 [4, R] (last dim contiguous) holding each row's (seed, request_id,
    sample_index, position); the kernel derives noise_key(...) itself, with no extra launches and no check of
    the values (the caller guarantees them in [0, 2**63)): the form the rollout engine uses every step.
    block_v (a power of two) only changes the loop step, never the result; None picks the default."""
    what = "gumbel_argmax"
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{what}: logits must be a 2-D tensor [rows, vocab]")
    allowed = (torch.float32,) if temperature is None else (torch.float32, torch.bfloat16, torch.float16)
    if logits.dtype not in allowed:
        raise ValueError(
            f"{what}: logits must be {' or '.join(str(d) for d in allowed)}"
            f"{' (raw logits with temperature=)' if temperature is not None else ''}, got {logits.dtype}"
        )
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{what}: temperature must be a finite number > 0, got {temperature}")
    _check_device(logits, what)
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"{what}: logits has an empty vocab dimension")
    if vocab >= _NO_INDEX:
        raise ValueError(f"{what}: vocab must be below 2**31 - 1, got {vocab}")
    if key_parts is not None:
        if keys is not None:
            raise ValueError(f"{what}: pass keys or key_parts, not both")
        if (
            not isinstance(key_parts, torch.Tensor)
            or key_parts.dtype != torch.int64
            or key_parts.shape != (4, rows)
            or (rows and key_parts.stride(1) != 1)
        ):
            raise ValueError(
                f"{what}: key_parts must be an int64 tensor [4, {rows}] with a contiguous last dim"
            )
        if key_parts.device != logits.device:
            raise ValueError(f"{what}: key_parts is on {key_parts.device}, the logits on {logits.device}")
        keys_arg, stride_p = key_parts, key_parts.stride(0)
    elif keys is None:
        raise ValueError(
            f"{what}: pass keys (int64 [R]) or key_parts (int64 [4, R]), the sampling noise's keys"
        )
    else:
        keys_arg, stride_p = _check_keys(keys, rows, logits.device, what), 0
    if greedy is not None:
        if not isinstance(greedy, torch.Tensor) or greedy.shape != (rows,) or greedy.dtype != torch.bool:
            raise ValueError(f"{what}: greedy must be a bool tensor of shape [{rows}]")
        if greedy.device != logits.device:
            raise ValueError(f"{what}: greedy is on {greedy.device}, the logits on {logits.device}")
        greedy = greedy.contiguous().view(torch.uint8)
    block = _BLOCK_V if block_v is None else int(block_v)
    if block < 16 or block & (block - 1):
        raise ValueError(f"{what}: block_v must be a power of two >= 16, got {block_v}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    splits, chunk = _vocab_split(rows, vocab, block, logits.device)
    parts_idx = out if splits == 1 else torch.empty(rows * splits, dtype=torch.int64, device=logits.device)
    parts_val = out if splits == 1 else torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
    _gumbel_argmax_kernel[(rows, splits)](
        logits,
        keys_arg,
        keys_arg if greedy is None else greedy,  # unused without greedy rows
        parts_idx,
        parts_val,  # unused without a split
        logits.stride(0),
        stride_p,
        vocab,
        chunk,
        1.0 if temperature is None else float(temperature),
        HAS_GREEDY=greedy is not None,
        KEY_PARTS=key_parts is not None,
        BLOCK_V=block,
        SCALE=temperature is not None,
        SPLIT=splits > 1,
        num_warps=8 if block >= 2048 else 4,
        **_LAUNCH_OPTS,
        **pdl(logits.device),
    )
    if splits > 1:
        _argmax_combine_kernel[(rows,)](
            parts_val,
            parts_idx,
            out,
            splits,
            BLOCK_S=triton.next_power_of_2(splits),
            **_LAUNCH_OPTS,
            **pdl(parts_val.device),
        )
    return out


def gumbel_noise_triton(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The noise gumbel_argmax adds: float32 [R, vocab_size], equal to sampler.gumbel_noise(keys, vocab_size)."""
    what = "gumbel_noise_triton"
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1:
        raise ValueError(f"{what}: keys must be a 1-D int64 tensor")
    _check_device(keys, what)
    keys = _check_keys(keys, keys.shape[0], keys.device, what)
    if not 0 <= vocab_size < _NO_INDEX:
        raise ValueError(f"{what}: vocab_size must be in [0, 2**31 - 1), got {vocab_size}")
    out = torch.empty((keys.shape[0], vocab_size), dtype=torch.float32, device=keys.device)
    if out.numel():
        grid = (keys.shape[0], triton.cdiv(vocab_size, _NOISE_BLOCK))
        _gumbel_noise_kernel[grid](
            keys, out, out.stride(0), vocab_size, BLOCK=_NOISE_BLOCK, **_LAUNCH_OPTS, **pdl(keys.device)
        )
    return out


def _gumbel_of_all_uniforms(device: torch.device | str) -> torch.Tensor:
    """G for every value the hash can give: float32 [2**23], entry i for h >> 9 == i (an exhaustive test hook)."""
    n = 1 << 23
    out = torch.empty(n, dtype=torch.float32, device=device)
    _check_device(out, "_gumbel_of_all_uniforms")
    _gumbel_of_uniform_kernel[(triton.cdiv(n, _NOISE_BLOCK),)](
        out, n, BLOCK=_NOISE_BLOCK, **_LAUNCH_OPTS, **pdl(out.device)
    )
    return out
