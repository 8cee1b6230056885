"""Rotary position embeddings as transformers defines them: the frequencies of each `rope_type` and the one fp32
cos|sin table the model indexes by absolute position on every path.

The table is computed in float64 and rounded once to float32, so it is the same on every device and for every
model dtype (rule 6 of the design notes). transformers computes the same formulas in float32 and casts cos/sin
to the model dtype; the difference is a rounding of the angle, far below the 1e-4 logprob tolerance of the
parity tests. YaRN's attention factor multiplies cos and sin (HF's `attention_scaling`), so it lives in the
table too and the CPU and Triton rope ops need no option for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# rope_type -> the keys of HF's rope dict that type reads (besides rope_type and rope_theta).
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}

# Types transformers has that exactrl refuses, with the reason given to the user.
REFUSED_ROPE_TYPES = {
    "longrope": "it switches frequency sets on the longest sequence in the batch, so a token's rotation would "
    "depend on the batch",
    "proportional": "not a rope type of the Qwen2/Qwen3/Llama models",
    "axial": "not a rope type of the Qwen2/Qwen3/Llama models",
}


@dataclass(frozen=True)
class RopeScaling:
    """HF's `rope_parameters` (transformers 5) / `rope_scaling` (4.x) beyond `rope_theta`.

    `dynamic` (dynamic NTK) is served for positions below max_position_embeddings, where transformers' dynamic
    RoPE is exactly the default one; past it transformers rescales every position by the longest sequence in
    the batch, which no batch-invariant engine can reproduce, and the model refuses such positions anyway."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn
    beta_fast: float | None = None  # yarn (HF: 32 when unset or 0)
    beta_slow: float | None = None  # yarn (HF: 1 when unset or 0)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn (HF: True when unset)

    def validate(self, where: str = "rope_scaling") -> None:
        if self.rope_type in REFUSED_ROPE_TYPES:
            raise ValueError(
                f"{where}: rope_type {self.rope_type!r} is not supported: {REFUSED_ROPE_TYPES[self.rope_type]}"
            )
        if self.rope_type not in ROPE_KEYS:
            raise ValueError(
                f"{where}: unknown rope_type {self.rope_type!r}; supported: {', '.join(ROPE_KEYS)}"
            )
        needs = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        }.get(self.rope_type, ())
        missing = [k for k in needs if getattr(self, k) is None]
        if missing:
            raise ValueError(f"{where}: rope_type {self.rope_type!r} needs {missing}")
        if self.factor is not None and not self.factor > 0:
            raise ValueError(f"{where}: factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError(f"{where}: llama3 needs high_freq_factor != low_freq_factor")

    def to_hf(self, rope_theta: float) -> dict:
        d = {"rope_type": self.rope_type, "rope_theta": rope_theta}
        for k in ROPE_KEYS[self.rope_type]:
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


def inv_freq_and_scale(
    rope: RopeScaling, head_dim: int, rope_theta: float, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float64, attention scaling of cos/sin): transformers' formulas of
    `modeling_rope_utils` for each rope type, in float64."""
    dim = head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (rope_theta**exponent)
    kind = rope.rope_type
    if kind in ("default", "dynamic"):  # dynamic == default below max_position_embeddings (see RopeScaling)
        return inv_freq, 1.0
    if kind == "linear":  # positions divided by factor, i.e. frequencies divided by it
        assert rope.factor is not None  # RopeScaling.validate: "linear" needs its factor
        return inv_freq / rope.factor, 1.0
    if kind == "llama3":
        factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
        old_len = rope.original_max_position_embeddings
        # RopeScaling.validate: "llama3" needs all four
        assert factor is not None and low is not None and high is not None and old_len is not None
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, the middle band
        # blends the two linearly in old_len / wavelen.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        orig = rope.original_max_position_embeddings
        assert orig is not None  # RopeScaling.validate: "yarn" needs it
        factor = rope.factor if rope.factor is not None else max_position_embeddings / orig

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        scale = rope.attention_factor
        if scale is None:
            if rope.mscale and rope.mscale_all_dim:
                scale = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
            else:
                scale = get_mscale(factor)
        beta_fast = rope.beta_fast or 32  # HF treats 0 as unset too
        beta_slow = rope.beta_slow or 1

        def correction_dim(rotations: float) -> float:
            # The dimension whose wavelength makes `rotations` turns over the original context.
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.truncate is None or rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
        return inv_freq, float(scale)
    raise ValueError(f"rope_type {kind!r} is not supported")


def rope_cos_sin(
    rope: RopeScaling, head_dim: int, rope_theta: float, max_position_embeddings: int
) -> torch.Tensor:
    """fp32 [max_position_embeddings, head_dim] table on the CPU: cos of each frequency (times the attention
    scaling) in the first half, sin (times it) in the second. Computed in float64, rounded once."""
    inv_freq, scale = inv_freq_and_scale(rope, head_dim, rope_theta, max_position_embeddings)
    freqs = torch.arange(max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scale).float()
