"""Reproducible, batch-invariant sampling: Gumbel-max with counter-based noise.

    token = argmax_v( logits[v] + G(key, v) ),   G ~ Gumbel(0, 1), independent over (key, v)

is an exact draw from softmax(logits). The noise G is a pure function of the row's 62-bit key and the vocab
index, so a row's token never depends on which other rows share the call, where the row sits in it, or how the
rows were chunked. The key comes from `noise_key(seed, request_id, sample_index, position)`: the same request
and sample get the same tokens whatever the scheduling (continuous batching, preemption, chunked prefill).

Bitwise reproducibility, CPU and CUDA alike, by construction:

* The integer hash uses int64 tensor ops only (xor, shifts, masks, products kept below 2**63), so it is exact
  everywhere; the same code runs on Python ints (`noise_key`) and on tensors (`noise_keys`).
* The uniform is u = ((h >> 9) + 0.5) * 2**-23, exact in float32 (24 significant bits), in (0, 1). The Gumbel transform -log(-log(u))
  (float32) and the top-p probabilities (float64) use logarithm/exponential written with IEEE basic operations
  only (+, -, *, / of tensors, frexp, floor, bit casts), never torch.log/exp, whose vectorised and scalar CPU
  paths (and CUDA) may differ in the last bit.
* The perturbed logits logits + G are formed in the logits' dtype (float32); argmax is exact and breaks ties
  towards the LOWEST vocab index (as torch.argmax does), also for greedy rows.
* Top-k / top-p are decided on sorted *values* (never on sort order of equal values) and top-p's cumulative
  sum runs on int64 fixed-point probabilities (exact and order-independent). Both keep every token tied with
  the last kept value, so ties at the boundary are kept together.

The cost is O(rows * vocab) elementwise work; rows are processed in chunks (`max_chunk_elements`) to bound
memory, which does not change any result. A fused kernel may replace it if it reproduces these bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, overload

import torch

_M32 = 0xFFFFFFFF
_INT63 = 1 << 63


# ---------------------------------------------------------------------------------------------------------------
# Integer hashing (works on Python ints and on int64 tensors alike; every intermediate stays in [0, 2**63))
# ---------------------------------------------------------------------------------------------------------------
def _mix32(x: Any) -> Any:
    """A 32-bit avalanche permutation of x in [0, 2**32): xorshift-multiply, two rounds.

    Constants from Wellons' hash-prospector (a low-bias variant of the one in the design notes). Both are below
    2**31, so each product stays below 2**63 and needs no splitting in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _key(seed: Any, request_id: Any, sample_index: Any, position: Any) -> Any:
    a, b = 0x243F6A88, 0x85A308D3
    for v in (seed, request_id, sample_index, position):
        for w in (v & _M32, v >> 32):
            a = _mix32(a ^ w)
            b = _mix32(b ^ _mix32(w ^ 0x9E3779B9))
    return ((a & 0x3FFFFFFF) << 32) | b


def noise_key(seed: int, request_id: int, sample_index: int, position: int) -> int:
    """The 62-bit sampling key (a positive int) of one sampled position; all inputs in [0, 2**63)."""
    for name, v in (
        ("seed", seed),
        ("request_id", request_id),
        ("sample_index", sample_index),
        ("position", position),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _INT63:
            raise ValueError(f"noise_key: {name} must be an int in [0, 2**63), got {v!r}")
    return int(_key(seed, request_id, sample_index, position))


def noise_keys(
    seed: torch.Tensor | int,
    request_id: torch.Tensor | int,
    sample_index: torch.Tensor | int,
    position: torch.Tensor | int,
) -> torch.Tensor:
    """Tensor version of noise_key (broadcasting, int64, on the device of the tensor inputs); equal elementwise."""
    device = next(
        (v.device for v in (seed, request_id, sample_index, position) if isinstance(v, torch.Tensor)), None
    )
    args = []
    for name, v in (
        ("seed", seed),
        ("request_id", request_id),
        ("sample_index", sample_index),
        ("position", position),
    ):
        t = torch.as_tensor(v, device=device)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"noise_keys: {name} must hold integers, got {t.dtype}")
        t = t.to(torch.int64)
        if bool((t < 0).any()):
            raise ValueError(f"noise_keys: {name} must be >= 0")
        args.append(t)
    return _key(*args)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """G(key, v) for every row key and vocab index v < vocab_size: float32 [R, vocab_size], in [-2.86, 17.33]."""
    keys = keys.to(torch.int64)
    s1 = _mix32((keys & _M32) ^ 0x68E31DA4)
    s2 = _mix32((keys >> 32) ^ _mix32(s1 ^ 0xB5297A4D))
    v = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=keys.device) ^ 0x1B56C4E9)
    h = _mix32(_mix32(v[None, :] ^ s1[:, None]) ^ s2[:, None])
    # 23 hash bits + 0.5: 24 significant bits, exact in float32; u in [2**-24, 1 - 2**-24], never 0 or 1.
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -_log(-_log(u))


# ---------------------------------------------------------------------------------------------------------------
# log / exp from IEEE basic operations (bit-identical on every device and code path)
# ---------------------------------------------------------------------------------------------------------------
_LN2 = math.log(2.0)
_SQRT_HALF = math.sqrt(0.5)


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive finite x (float32: relative error ~1e-7; float64: ~1e-13)."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # now in [sqrt(1/2), sqrt(2))
    e = e.to(x.dtype) - small.to(x.dtype)
    s = (m - 1.0) / (m + 1.0)  # log(m) = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), |s| < 0.172
    z = s * s
    terms = 5 if x.dtype == torch.float32 else 8
    p = torch.full_like(z, 1.0 / (2 * terms + 1))
    for k in range(terms - 1, -1, -1):
        p = p * z + 1.0 / (2 * k + 1)
    return e * _LN2 + (s * p) * 2.0


def _exp_nonpositive(x: torch.Tensor) -> torch.Tensor:
    """exp(x) of float64 x in [-60, 0] (relative error ~1e-12; exp(0) == 1 exactly)."""
    k = torch.floor(x * (1.0 / _LN2) + 0.5)
    r = x - k * _LN2  # |r| <~ ln2 / 2
    p = torch.full_like(r, 1.0 / math.factorial(10))
    for i in range(9, -1, -1):
        p = p * r + 1.0 / math.factorial(i)
    scale = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)  # exactly 2**k
    return p * scale


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------
@overload
def _row_param(t: torch.Tensor, name: str, rows: int, device: torch.device) -> torch.Tensor: ...
@overload
def _row_param(t: torch.Tensor | None, name: str, rows: int, device: torch.device) -> torch.Tensor | None: ...
def _row_param(t: torch.Tensor | None, name: str, rows: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    t = torch.as_tensor(t, device=device)
    if t.shape != (rows,):
        raise ValueError(f"sample: {name} must have shape [{rows}] (one value per row), got {tuple(t.shape)}")
    return t


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide row r of float32 logits by temperature[r]; rows with temperature 0 (greedy) stay as they are."""
    temperature = _row_param(temperature, "temperature", logits.shape[0], logits.device)
    if bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all()):
        raise ValueError("temperature must be finite and >= 0")
    t = temperature.to(logits.dtype)
    return logits / torch.where(t > 0, t, torch.ones_like(t))[:, None]


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    max_chunk_elements: int = 1 << 24,
) -> torch.Tensor:
    """One token per row: int64 [R].

    logits: float32 [R, V], already divided by the row's temperature (see apply_temperature).
    keys: int64 [R], noise keys (noise_keys(...)); rows with equal keys and logits give equal tokens.
    top_k: int [R], keep the k largest logits (and ties with the k-th); 0 = off.
    top_p: float [R] in (0, 1], keep the smallest set of largest logits whose probability reaches p (and ties
        with its last value; at least one token); 1.0 = off. Applied after top-k, on the renormalised rest.
    greedy: bool [R], rows that take argmax(logits) (lowest index on ties) with no noise and no filtering.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("sample: logits must be a 2-D tensor [rows, vocab]")
    if logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"sample: logits must be float32 (or float64), got {logits.dtype}")
    rows, vocab = logits.shape
    device = logits.device
    if vocab == 0:
        raise ValueError("sample: logits has an empty vocab dimension")
    keys = _row_param(keys, "keys", rows, device)
    if keys.dtype != torch.int64 or bool((keys < 0).any()):
        raise ValueError("sample: keys must be non-negative int64")
    top_k = _row_param(top_k, "top_k", rows, device)
    if top_k is not None:
        if top_k.dtype.is_floating_point or top_k.dtype == torch.bool or bool((top_k < 0).any()):
            raise ValueError("sample: top_k must be integers >= 0 (0 = off)")
        top_k = top_k.to(torch.int64)
        if not bool((top_k > 0).any()):
            top_k = None
    top_p = _row_param(top_p, "top_p", rows, device)
    if top_p is not None:
        if not top_p.dtype.is_floating_point or not bool(((top_p > 0) & (top_p <= 1)).all()):
            raise ValueError("sample: top_p must be floats in (0, 1] (1 = off)")
        top_p = top_p.to(torch.float64)
        if not bool((top_p < 1).any()):
            top_p = None
    greedy = _row_param(greedy, "greedy", rows, device)
    if greedy is not None and greedy.dtype != torch.bool:
        raise ValueError("sample: greedy must be a bool tensor")

    out = torch.empty(rows, dtype=torch.int64, device=device)
    step = max(1, max_chunk_elements // vocab)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chunk = logits[r0:r1]
        kept = _filter(
            chunk, None if top_k is None else top_k[r0:r1], None if top_p is None else top_p[r0:r1]
        )
        tokens = (kept + gumbel_noise(keys[r0:r1], vocab).to(kept.dtype)).argmax(dim=-1)
        if greedy is not None:
            tokens = torch.where(greedy[r0:r1], chunk.argmax(dim=-1), tokens)
        out[r0:r1] = tokens
    return out


def _filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (value-based, see the module docstring)."""
    if top_k is None and top_p is None:
        return logits
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    vocab = logits.shape[1]
    srt = torch.sort(logits, dim=-1, descending=True).values
    cutoff = neg_inf.expand(logits.shape[0], 1)
    if top_k is not None:
        k = top_k.clamp(max=vocab)
        kth = srt.gather(1, (k - 1).clamp(min=0)[:, None])
        cutoff = torch.where((k > 0)[:, None], kth, cutoff)
        srt = torch.where(srt >= cutoff, srt, neg_inf)
    if top_p is not None:
        top = srt[:, :1].to(torch.float64)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        x = (srt.to(torch.float64) - top).clamp(min=-60.0)
        q = torch.floor(_exp_nonpositive(x) * 2.0**40).to(torch.int64)  # fixed-point probabilities
        csum = torch.cumsum(q, dim=-1)  # int64: exact whatever the summation order
        before = csum - q
        threshold = torch.ceil(csum[:, -1:].to(torch.float64) * top_p[:, None]).to(torch.int64)
        count = (before < threshold).sum(dim=-1).clamp(min=1)
        pth = srt.gather(1, (count - 1)[:, None])
        cutoff = torch.where((top_p < 1)[:, None], torch.maximum(cutoff, pth), cutoff)
    return torch.where(logits >= cutoff, logits, neg_inf)


# ---------------------------------------------------------------------------------------------------------------
# Parameters and stop strings
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SamplingParams:
    """How to sample one prompt. temperature 0 means greedy; top_k 0 and top_p 1 mean no filtering; `stop`
    holds stop strings (matched on the detokenised completion), `stop_token_ids` stop tokens; `n` samples are
    drawn per prompt, sample j with noise key noise_key(seed, request_id, j, position)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field; return self."""

        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_real(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 = off)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of ints >= 0")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if not is_int(self.seed) or not 0 <= self.seed < _INT63:
            raise bad("seed", "an int in [0, 2**63)")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        return self


def find_stop_string(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string begins in text, among matches that end after index `start` (the length
    the text had before the newest tokens), or None. Only the tail text[start - len(stop) + 1:] is searched for
    each stop, so a stop spanning several tokens is found as soon as its last character arrives, and calling
    this after every step costs O(new text). Truncate the completion text at the returned index."""
    if start < 0:
        raise ValueError(f"find_stop_string: start must be >= 0, got {start}")
    best: int | None = None
    for stop in stops:
        if not stop:
            raise ValueError("find_stop_string: stop strings must be non-empty")
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
