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
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")

# config.json keys that change the numerics and are read here (with HF's default when absent). Every other key is
# either refused below when set to something exactrl does not implement, or ignored on purpose because
# transformers' Qwen2/Qwen3/Llama classes ignore it too (the table in docs/architecture.md lists them).
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# HF's defaults for keys a config.json may leave out, per architecture (transformers 5 config classes).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048},
    # The MoE classes have no head_dim field: their attention reads hidden_size // heads unless config.json has one.
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "qwen2_moe": {
        "num_key_value_heads": 16,
        "max_position_embeddings": 32768,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
}

# Options of other mixture-of-experts families that change the numbers and that exactrl does not implement, with
# the values that mean "off". A Qwen MoE config.json carrying one of them set otherwise is refused by name: its
# author expects behaviour that neither exactrl nor transformers' Qwen MoE classes would give.
_FOREIGN_MOE_KEYS: dict[str, tuple[Any, ...]] = {
    "n_group": (None, 1),  # DeepSeek-V2/V3 grouped routing: experts chosen within the best groups
    "topk_group": (None, 1),
    "topk_method": (None, "greedy"),
    "scoring_func": (None, "softmax"),  # DeepSeek-V3's sigmoid scores
    "routed_scaling_factor": (None, 1, 1.0),
    "n_routed_experts": (None,),
    "n_shared_experts": (None, 0),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "swiglu_limit": (None,),  # gpt-oss: clamped SwiGLU activations
    "router_jitter_noise": (None, 0, 0.0),  # Mixtral: multiplicative noise on the router input
    "moe_router_bias": (None, False),
    "use_attention_sinks": (None, False),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of the one decoder exactrl implements: Qwen2, Qwen3 and Llama are this decoder with
    different options (biases, per-head q/k norm, RoPE scaling); Qwen3-MoE and Qwen2-MoE replace the MLP of some
    layers by a mixture of experts (`exactrl.model.moe`), with transformers' rule for which (`is_moe_layer`)."""

    # "qwen3" (q/k norm), "qwen2" (q/k/v bias), "llama" (optional attention / MLP biases), "qwen3_moe" (qwen3's
    # attention, sparse MLPs), "qwen2_moe" (qwen2's attention, sparse MLPs with a gated shared expert)
    architecture: str
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
    # -- mixture of experts (qwen3_moe, qwen2_moe; the defaults mean a dense model) -----------------------------
    num_experts: int = 0  # routed experts of each sparse layer
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # hidden width of each routed expert (intermediate_size: dense layers')
    norm_topk_prob: bool = (
        False  # divide the k routing weights by their sum (else: the softmax probabilities)
    )
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP
    shared_expert_intermediate_size: int = 0  # qwen2_moe: the always-on expert's width (sigmoid-gated)
    qkv_bias_off: bool = False  # qwen2_moe with HF `qkv_bias: false` (Qwen2-MoE's q/k/v biases are optional)

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        if self.architecture in ("qwen2", "qwen2_moe"):
            return not self.qkv_bias_off
        return self.attention_bias

    @property
    def is_moe(self) -> bool:
        return self.architecture in MOE_ARCHITECTURES

    @property
    def has_shared_expert(self) -> bool:
        return self.architecture == "qwen2_moe"

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer): sparse unless listed in
        mlp_only_layers, every decoder_sparse_step-th layer counting from 1."""
        return (
            self.is_moe
            and i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    def validate(self) -> None:
        archs = ("qwen2", "qwen3", "llama", *MOE_ARCHITECTURES)
        if self.architecture not in archs:
            raise ValueError(
                f"model architecture {self.architecture!r} is not supported ({', '.join(archs)})"
            )
        if self.architecture in ("qwen2", "qwen2_moe") and self.attention_bias:
            raise ValueError(
                "attention_bias is an option of qwen3/qwen3_moe/llama; qwen2 always has q/k/v biases and no "
                "o_proj bias"
            )
        if self.qkv_bias_off and self.architecture != "qwen2_moe":
            raise ValueError(
                "qkv_bias_off is an option of qwen2_moe (HF qkv_bias); qwen2 always has q/k/v biases"
            )
        self._validate_moe()
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

    def _validate_moe(self) -> None:
        moe_fields = {
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "moe_intermediate_size": 0,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": (),
            "shared_expert_intermediate_size": 0,
        }
        if not self.is_moe:
            set_here = [k for k, off in moe_fields.items() if getattr(self, k) != off]
            if set_here:
                raise ValueError(
                    f"{', '.join(set_here)} are mixture-of-experts options: architecture {self.architecture!r} "
                    "is dense (use qwen3_moe or qwen2_moe)"
                )
            return
        if not isinstance(self.mlp_only_layers, tuple):
            raise ValueError(
                f"mlp_only_layers must be a tuple of layer indices, got {self.mlp_only_layers!r}"
            )
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model {name} must be an integer >= 1 for {self.architecture}, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} is more than num_experts {self.num_experts}"
            )
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layer indices 0..{self.num_layers - 1}")
        if self.has_shared_expert and self.shared_expert_intermediate_size < 1:
            raise ValueError(
                "qwen2_moe needs shared_expert_intermediate_size >= 1 (every Qwen2-MoE layer has a shared expert), "
                f"got {self.shared_expert_intermediate_size}"
            )
        if not self.has_shared_expert and self.shared_expert_intermediate_size:
            raise ValueError(
                f"shared_expert_intermediate_size is an option of qwen2_moe; {self.architecture} has no shared expert"
            )
        if not any(self.is_moe_layer(i) for i in range(self.num_layers)):
            raise ValueError(
                f"no layer of this {self.architecture} model is sparse (decoder_sparse_step "
                f"{self.decoder_sparse_step}, mlp_only_layers {list(self.mlp_only_layers)}, {self.num_layers} "
                "layers): use a dense architecture"
            )

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
        layers = sum(
            attn + 2 * d + (self._moe_params(self.num_experts) if self.is_moe_layer(n) else mlp)
            for n in range(self.num_layers)
        )
        return v * d * (1 if self.tie_word_embeddings else 2) + layers + d

    def _moe_params(self, experts: int) -> int:
        """Parameters of one sparse MLP counting `experts` routed experts (all of them, or the k a token uses)."""
        d = self.hidden_size
        shared = (3 * d * self.shared_expert_intermediate_size + d) if self.has_shared_expert else 0
        return self.num_experts * d + experts * 3 * d * self.moe_intermediate_size + shared

    def num_active_params(self) -> int:
        """Parameters one token's forward reads: num_params with each sparse layer's routed experts counted
        num_experts_per_tok times instead of num_experts times (the same as num_params for a dense model)."""
        unused = self.num_experts - self.num_experts_per_tok
        sparse = sum(self.is_moe_layer(n) for n in range(self.num_layers))
        return self.num_params() - sparse * unused * 3 * self.hidden_size * self.moe_intermediate_size

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
        if self.architecture != "llama":
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.architecture in ("qwen3", "qwen3_moe", "llama"):
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = self.mlp_bias
            d["pretraining_tp"] = 1
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        if self.architecture == "qwen2_moe":
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            d["qkv_bias"] = not self.qkv_bias_off
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
        if arch != "llama":
            if d.get("use_sliding_window"):
                refuse("use_sliding_window", "sliding-window attention is not implemented")
            if any(t != "full_attention" for t in d.get("layer_types") or []):
                refuse("layer_types", "every layer must be full_attention (no sliding window)")
        attention_bias = bool(d.get("attention_bias", False)) if arch not in ("qwen2", "qwen2_moe") else False
        mlp_bias = bool(d.get("mlp_bias", False)) if arch == "llama" else False
        defaults = _HF_DEFAULTS[arch]
        moe = _moe_from_hf(d, arch, defaults, refuse) if arch in MOE_ARCHITECTURES else {}

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
            **moe,
        )
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _moe_from_hf(d: dict[str, Any], arch: str, defaults: dict[str, Any], refuse: Any) -> dict[str, Any]:
    """The ModelConfig MoE fields of a qwen3_moe / qwen2_moe config.json (transformers' defaults for absent
    keys); options of other MoE families set to something other than "off" are refused by name."""
    for key, off in _FOREIGN_MOE_KEYS.items():
        if key in d and d[key] not in off:
            refuse(key, f"an option of another mixture-of-experts family; {arch} routes with a softmax top-k")
    experts = d.get("num_experts")
    if arch == "qwen3_moe":
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (an attribute alias).
        alias = d.get("num_local_experts")
        if experts is not None and alias is not None and experts != alias:
            refuse("num_local_experts", f"it disagrees with num_experts={experts}")
        experts = experts if experts is not None else alias
        if d.get("shared_expert_intermediate_size"):
            refuse(
                "shared_expert_intermediate_size",
                "qwen3_moe has no shared expert (transformers' Qwen3-MoE ignores the key; a checkpoint with one "
                "is another architecture)",
            )
    elif d.get("num_local_experts") not in (None, d.get("num_experts", defaults["num_experts"])):
        refuse("num_local_experts", "qwen2_moe reads num_experts")
    if experts is None:
        experts = defaults["num_experts"]
    layers = d.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        refuse("mlp_only_layers", "it must be a list of layer indices")
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": d.get("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "moe_intermediate_size": d.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": d.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(sorted(set(layers))),
    }
    if arch == "qwen2_moe":
        out["shared_expert_intermediate_size"] = d.get(
            "shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"]
        )
        out["qkv_bias_off"] = not d.get("qkv_bias", True)
    return out


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


_Q: dict[str, Any] = dict(
    architecture="qwen3", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960
)
_Q2: dict[str, Any] = dict(
    architecture="qwen2", vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768
)
# Llama 3.x: 128k context through the llama3 RoPE scaling of an 8k-trained model.
_L: dict[str, Any] = dict(
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
    # The tiny shape as a Qwen3-MoE: 8 experts of width 64, top 2 renormalised; layer 0 keeps a dense MLP (the
    # mix a real config gets from mlp_only_layers / decoder_sparse_step, so both MLP kinds run in every test).
    "tiny-moe": ModelConfig(
        architecture="qwen3_moe",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
    ),
    # The tiny shape as a Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, raw top-k probabilities, every
    # second layer sparse.
    "tiny-qwen2-moe": ModelConfig(
        architecture="qwen2_moe",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=2,
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
    # Qwen/Qwen3-30B-A3B: 48 layers of 128 experts (8 active, renormalised), 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        **{**_Q, "architecture": "qwen3_moe"},
    ),
    # Qwen/Qwen1.5-MoE-A2.7B: 24 layers of 60 experts (4 active, raw probabilities) plus a shared expert, 14.3B
    # parameters, 2.7B active.
    "qwen1.5-moe-a2.7b": ModelConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        tie_word_embeddings=False,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        **{**_Q2, "architecture": "qwen2_moe", "max_position_embeddings": 8192},
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model shape; keyword overrides (e.g. vocab_size) replace fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
