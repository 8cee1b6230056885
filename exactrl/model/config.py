"""Model shapes: `ModelConfig`, the named presets, and conversion from/to HF `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen2/Qwen3 dense decoder."""

    architecture: str  # "qwen3" (QK-norm, no QKV bias) or "qwen2" (QKV bias, no QK-norm)
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

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    def validate(self) -> None:
        if self.architecture not in ("qwen2", "qwen3"):
            raise ValueError(f"model architecture {self.architecture!r} is not supported (qwen2, qwen3)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")

    def num_params(self) -> int:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = (
            d * q
            + 2 * d * kv
            + q * d
            + (q + 2 * kv if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        layer = attn + 3 * d * i + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d

    # -- HF config.json ---------------------------------------------------------------------------------
    def to_hf(self, dtype: str) -> dict[str, Any]:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
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
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},  # transformers 5.x
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if self.architecture == "qwen3":
            d["attention_bias"] = False
        return d

    @staticmethod
    def from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = d.get("model_type") if d.get("model_type") in ("qwen2", "qwen3") else None
        if arch is None:
            raise ValueError(
                f"{where}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"exactrl supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "qwen3" and d.get("attention_bias"):
            raise ValueError(f"{where}: Qwen3 with attention_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise ValueError(f"{where}: sliding-window attention is not supported (use_sliding_window=true)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"{where}: RoPE scaling {rope_type!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"{where}: missing required fields {missing}")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_Q = dict(architecture="qwen3", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960)
_Q2 = dict(architecture="qwen2", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768)

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
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model shape; keyword overrides (e.g. vocab_size) replace fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
