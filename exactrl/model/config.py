"""Model shapes: `ModelConfig`, the named presets, and conversion from/to HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from exactrl.model.rope import REFUSED_ROPE_TYPES, ROPE_KEYS, RopeScaling, rope_cos_sin

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}

# config.json keys that change the numerics and are read here (with HF's default when absent). Every other key is
# either refused below when set to something exactrl does not implement, or ignored on purpose because
# transformers' Qwen2/Qwen3/Llama classes ignore it too (the table in docs/architecture.md lists them).
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# HF's defaults for keys a config.json may leave out, per architecture (transformers 5 config classes).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048},
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of the one dense decoder exactrl implements: Qwen2, Qwen3 and Llama are this decoder
    with different options (biases, per-head q/k norm, RoPE scaling)."""

    architecture: str  # "qwen3" (q/k norm), "qwen2" (q/k/v bias), "llama" (optional attention / MLP biases)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    attention_bias: bool = False  # q/k/v/o biases (HF `attention_bias` of Qwen3 and Llama)
    mlp_bias: bool = False  # gate/up/down biases (HF `mlp_bias` of Llama)
    rope_scaling: RopeScaling = RopeScaling()

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    def validate(self) -> None:
        if self.architecture not in ("qwen2", "qwen3", "llama"):
            raise ValueError(
                f"model architecture {self.architecture!r} is not supported (qwen2, qwen3, llama)"
            )
        if self.architecture == "qwen2" and self.attention_bias:
            raise ValueError(
                "attention_bias is an option of qwen3/llama; qwen2 always has q/k/v biases and no o_proj bias"
            )
        if self.architecture != "llama" and self.mlp_bias:
            raise ValueError("mlp_bias is an option of llama; Qwen MLPs have no biases")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        self.rope_scaling.validate()

    def num_params(self) -> int:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = (
            d * q
            + 2 * d * kv
            + q * d
            + (q + 2 * kv if self.qkv_bias else 0)
            + (d if self.o_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        mlp = 3 * d * i + ((2 * i + d) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d

    def rope_table(self) -> torch.Tensor:
        """fp32 [max_position_embeddings, head_dim] cos|sin table on the CPU (`exactrl.model.rope`)."""
        return rope_cos_sin(self.rope_scaling, self.head_dim, self.rope_theta, self.max_position_embeddings)

    # -- HF config.json ---------------------------------------------------------------------------------
    def to_hf(self, dtype: str) -> dict[str, Any]:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        rope = self.rope_scaling.to_hf(self.rope_theta)
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,  # transformers 4.x
            "rope_parameters": rope,  # transformers 5.x
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if self.rope_scaling.rope_type != "default":
            d["rope_scaling"] = dict(rope)  # transformers 4.x reads the scaling from here
        if self.architecture in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.architecture in ("qwen3", "llama"):
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = self.mlp_bias
            d["pretraining_tp"] = 1
        return d

    @staticmethod
    def from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Read an HF config.json dict. Every key that changes the numerics is honoured as transformers does
        or refused with an error naming it and its value."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = d.get("model_type") if d.get("model_type") in _HF_DEFAULTS else None
        if arch is None:
            raise ValueError(
                f"{where}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"exactrl supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{where}: missing required fields {missing}")

        def refuse(key: str, why: str) -> None:
            raise ValueError(f"{where}: {key}={json.dumps(d.get(key))} is not supported: {why}")

        if d.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "the MLP is SiLU-gated (silu)")
        if d.get("attention_dropout") not in (None, 0, 0.0):
            refuse("attention_dropout", "exactrl's attention has no dropout")
        if d.get("quantization_config") is not None:
            refuse("quantization_config", "quantized checkpoints are not loaded; give a bf16/fp32 checkpoint")
        if d.get("partial_rotary_factor") not in (None, 1, 1.0):
            refuse("partial_rotary_factor", "RoPE rotates the whole head")
        if arch in ("qwen2", "qwen3"):
            if d.get("use_sliding_window"):
                refuse("use_sliding_window", "sliding-window attention is not implemented")
            if any(t != "full_attention" for t in d.get("layer_types") or []):
                refuse("layer_types", "every layer must be full_attention (no sliding window)")
        attention_bias = bool(d.get("attention_bias", False)) if arch != "qwen2" else False
        mlp_bias = bool(d.get("mlp_bias", False)) if arch == "llama" else False

        defaults = _HF_DEFAULTS[arch]
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or defaults["num_key_value_heads"] or heads
        # Qwen2's config class has no head_dim, but its attention reads one from config.json (getattr), as here.
        head_dim = d.get("head_dim") or defaults.get("head_dim") or d["hidden_size"] // heads
        max_pos = int(d.get("max_position_embeddings") or defaults["max_position_embeddings"])
        rope, theta = _rope_from_hf(d, where, max_pos)
        eos = d.get("eos_token_id")
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
            rope_scaling=rope,
        )
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_from_hf(d: dict[str, Any], where: str, max_pos: int) -> tuple[RopeScaling, float]:
    """(RopeScaling, rope_theta) from `rope_scaling` (4.x, wins when set, as in transformers) or
    `rope_parameters` (5.x), with the top-level `rope_theta` and `original_max_position_embeddings`."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if not isinstance(d.get(key) or {}, dict):
        raise ValueError(f"{where}: {key} must be an object, got {json.dumps(d.get(key))}")
    rope = dict(d.get(key) or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: {key} per layer type is not supported: {json.dumps(rope)}")
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    if rope.pop("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ValueError(
            f"{where}: {key}.partial_rotary_factor is not supported (RoPE rotates the whole head)"
        )
    where_rope = f"{where}: {key}"
    if kind in REFUSED_ROPE_TYPES or kind not in ROPE_KEYS:
        RopeScaling(rope_type=kind).validate(where_rope)
    # transformers gives a top-level original_max_position_embeddings priority for these types and falls back
    # to max_position_embeddings.
    if kind in ("llama3", "yarn"):
        if d.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", max_pos)
    unknown = sorted(set(rope) - set(ROPE_KEYS[kind]))
    if unknown:
        raise ValueError(
            f"{where_rope}: keys {unknown} are not understood for rope_type {kind!r} "
            f"(it reads {list(ROPE_KEYS[kind]) or 'no other keys'})"
        )
    out = RopeScaling(rope_type=kind, **rope)
    out.validate(where_rope)
    return out, theta


_Q = dict(architecture="qwen3", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960)
_Q2 = dict(architecture="qwen2", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768)
# Llama 3.x: 128k context through the llama3 RoPE scaling of an 8k-trained model.
_L = dict(
    architecture="llama",
    vocab_size=128256,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling(
        "llama3",
        factor=factor,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


PRESETS: dict[str, ModelConfig] = {
    # Small enough to train on 2 CPU cores in minutes; the vocabulary is set from the tokenizer at init time.
    "tiny": ModelConfig(
        architecture="qwen3",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    ),
    # The tiny shape as a Llama: no q/k norm, untied head, llama3 RoPE scaling of a 256-token original context.
    "tiny-llama": ModelConfig(
        architecture="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_scaling=RopeScaling(
            "llama3",
            factor=8.0,
            original_max_position_embeddings=256,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
    ),
    "qwen3-0.6b": ModelConfig(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        **_Q,
    ),
    "qwen3-1.7b": ModelConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        **_Q,
    ),
    "qwen3-4b": ModelConfig(
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        **_Q,
    ),
    "qwen3-8b": ModelConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        **_Q,
    ),
    "qwen2.5-0.5b": ModelConfig(
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        **_Q2,
    ),
    "qwen2.5-1.5b": ModelConfig(
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        tie_word_embeddings=True,
        **_Q2,
    ),
    "llama3.2-1b": ModelConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling=_llama3_rope(32.0),
        **_L,
    ),
    "llama3.2-3b": ModelConfig(
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling=_llama3_rope(32.0),
        **_L,
    ),
    "llama3.1-8b": ModelConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_scaling=_llama3_rope(8.0),
        **_L,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model shape; keyword overrides (e.g. vocab_size) replace fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
