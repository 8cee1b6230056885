"""One attention step's inputs for the fused q/k norm + RoPE + KV-write tests (interpreter and GPU files), and the
unfused sequence the fused op must reproduce bit for bit."""

from __future__ import annotations

from typing import NamedTuple

import torch

EPS = 1e-6


class QKStep(NamedTuple):
    q: torch.Tensor  # [T, Hq, Dh], a view of the packed q|k|v projection (row stride of all three)
    k: torch.Tensor  # [T, Hkv, Dh], the same
    v: torch.Tensor  # [T, Hkv, Dh], the same
    q_weight: torch.Tensor  # [Dh]
    k_weight: torch.Tensor  # [Dh]
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [P, Dh] fp32
    slots: torch.Tensor  # [T] int64 slot_mapping
    cache: tuple[torch.Tensor, torch.Tensor]  # [pages, page, Hkv, Dh] each, random bytes before the step


def rope_table(n_pos: int, dh: int, device) -> torch.Tensor:
    ang = (
        torch.arange(n_pos, dtype=torch.float64)[:, None]
        * (1e6 ** (-torch.arange(dh // 2) / (dh // 2)))[None]
    )
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float().to(device)


def make_step(
    T: int,
    hq: int,
    hkv: int,
    dh: int,
    dtype: torch.dtype,
    device,
    seed: int = 0,
    pages: int = 24,
    page: int = 16,
    n_pos: int = 4096,
    pad: int = 0,
) -> QKStep:
    """A step as the engine runs it: q/k/v views of one packed projection output; trained-looking norm weights
    (not ones, some near zero, some negative); positions scattered and not from 0; slots scattered over the
    pages. The last `pad` rows are a decode bucket's padding rows: token 0 at position 0 (identical rows) writing
    to one shared scratch slot in the last page, which no real row uses."""
    if T - pad > (pages - 1) * page:
        raise ValueError(f"{T - pad} real rows do not fit {pages - 1} pages of {page}")
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * dh, generator=g) * 2.0
    if pad:
        qkv[T - pad :] = torch.randn((hq + 2 * hkv) * dh, generator=g)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : hq * dh].view(T, hq, dh)
    k = qkv[:, hq * dh : (hq + hkv) * dh].view(T, hkv, dh)
    v = qkv[:, (hq + hkv) * dh :].view(T, hkv, dh)
    q_weight = (1 + 0.6 * torch.randn(dh, generator=g)).to(dtype).to(device)
    k_weight = (0.8 + 0.6 * torch.randn(dh, generator=g)).to(dtype).to(device)
    positions = torch.randint(7, n_pos, (T,), generator=g)
    positions[T - pad :] = 0
    slots = torch.randperm((pages - 1) * page, generator=g)[:T]
    slots[T - pad :] = (pages - 1) * page + 5  # the scratch slot
    cache = tuple(
        torch.randn(pages, page, hkv, dh, generator=g).to(dtype).to(device) for _ in range(2)
    )  # not zeros: a write of the wrong bytes, or to the wrong slot, shows
    return QKStep(
        q,
        k,
        v,
        q_weight,
        k_weight,
        positions.to(device),
        rope_table(n_pos, dh, device),
        slots.to(device),
        cache,
    )


def unfused(ops, s: QKStep, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's three launches on a Triton backend: rms_norm_rope for q, for k, then the paged K/V write."""
    from exactrl.ops.triton.kv_write import write_kv_cache

    q = ops.rms_norm_rope(s.q, s.q_weight, EPS, s.positions, s.cos_sin)
    k = ops.rms_norm_rope(s.k, s.k_weight, EPS, s.positions, s.cos_sin)
    write_kv_cache(k, s.v, cache, s.slots)
    return q, k


def fused(ops, s: QKStep, cache, **changes) -> tuple[torch.Tensor, torch.Tensor]:
    s = s._replace(**changes)
    return ops.qk_norm_rope(
        s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, s.positions, s.cos_sin, cache, s.slots
    )


def clone_cache(s: QKStep) -> tuple[torch.Tensor, torch.Tensor]:
    return s.cache[0].clone(), s.cache[1].clone()


def differences(
    got: tuple[torch.Tensor, ...],
    got_cache: tuple[torch.Tensor, ...],
    ref: tuple[torch.Tensor, ...],
    ref_cache,
) -> list[str]:
    """Names of the outputs (q, k, k cache, v cache) whose bits differ; empty when all are equal."""
    pairs = zip(("q", "k", "k cache", "v cache"), (*got, *got_cache), (*ref, *ref_cache))
    return [name for name, a, b in pairs if not torch.equal(a, b)]


def one_ulp_away(w: torch.Tensor, index: int = 3) -> torch.Tensor:
    """w with element `index` moved one ulp away from zero (a trained weight at the neighbouring value)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[w.dtype]
    w = w.clone()
    w.view(bits)[index] += 1
    return w
