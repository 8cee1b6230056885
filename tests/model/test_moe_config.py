"""Mixture-of-experts options of config.json: read with transformers' semantics and defaults, written back so that
transformers builds the same model, and every option exactrl does not implement refused by name."""

import json

import pytest
import torch

from exactrl.model.config import ModelConfig, preset

transformers = pytest.importorskip("transformers")

_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _base(arch: str = "qwen3_moe", **extra) -> dict:
    d = {
        "architectures": [_NAMES[arch]],
        "model_type": arch,
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    if arch == "qwen2_moe":
        d["shared_expert_intermediate_size"] = 48
    d.update(extra)
    return d


@pytest.mark.parametrize(
    "arch,extra,message",
    [
        ("qwen3_moe", {"n_group": 8, "topk_group": 4}, "n_group=8 is not supported: an option of another"),
        ("qwen2_moe", {"topk_group": 2}, "topk_group=2 is not supported"),
        ("qwen3_moe", {"scoring_func": "sigmoid"}, 'scoring_func="sigmoid" is not supported'),
        ("qwen3_moe", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 is not supported"),
        ("qwen3_moe", {"swiglu_limit": 7.0}, "swiglu_limit=7.0 is not supported"),
        ("qwen2_moe", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not supported"),
        ("qwen3_moe", {"first_k_dense_replace": 1}, "first_k_dense_replace=1 is not supported"),
        ("qwen3_moe", {"n_shared_experts": 1}, "n_shared_experts=1 is not supported"),
        ("qwen3_moe", {"use_attention_sinks": True}, "use_attention_sinks=true is not supported"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "qwen3_moe has no shared expert"),
        ("qwen3_moe", {"num_local_experts": 4}, "num_local_experts=4 is not supported: it disagrees"),
        (
            "qwen2_moe",
            {"num_local_experts": 4},
            "num_local_experts=4 is not supported: qwen2_moe reads num_experts",
        ),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ("qwen3_moe", {"layer_types": ["sliding_attention"] * 4}, "layer_types=.*sliding_attention"),
        ("qwen3_moe", {"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
        ("qwen3_moe", {"mlp_only_layers": "0,1"}, "mlp_only_layers=.*must be a list of layer indices"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8"),
        ("qwen3_moe", {"num_experts": 0}, "num_experts must be an integer >= 1 for qwen3_moe"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1"),
        ("qwen3_moe", {"mlp_only_layers": [1, 7]}, r"mlp_only_layers \[7\] are not layer indices 0..3"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1, 2, 3]}, "no layer of this qwen3_moe model is sparse"),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": 0},
            "qwen2_moe needs shared_expert_intermediate_size",
        ),
        (
            "qwen3_moe",
            {"architectures": ["GptOssForCausalLM"]},
            "unsupported architecture.*GptOssForCausalLM",
        ),
        ("qwen3_moe", {"architectures": ["DeepseekV3ForCausalLM"]}, "unsupported architecture.*DeepseekV3"),
        (
            "qwen2_moe",
            {"architectures": ["MixtralForCausalLM"]},
            "unsupported architecture.*MixtralForCausalLM",
        ),
    ],
)
def test_unsupported_moe_options_are_refused_by_name(arch, extra, message):
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_hf(_base(arch, **extra), where="ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ")


def test_off_values_of_foreign_options_are_accepted():
    """A foreign key at its "off" value changes nothing (exporters write them with defaults)."""
    plain = ModelConfig.from_hf(_base())
    assert plain == ModelConfig.from_hf(
        _base(
            n_group=1,
            topk_group=1,
            scoring_func="softmax",
            routed_scaling_factor=1.0,
            router_jitter_noise=0.0,
        )
    )
    # Keys transformers' Qwen MoE classes do not read for the forward pass are ignored, as there.
    assert plain == ModelConfig.from_hf(_base(output_router_logits=True, router_aux_loss_coef=0.02))


def test_moe_options_on_a_dense_architecture_are_refused():
    with pytest.raises(ValueError, match="num_experts, num_experts_per_tok are mixture-of-experts options"):
        preset("tiny", num_experts=4, num_experts_per_tok=2).validate()
    with pytest.raises(ValueError, match="qkv_bias_off is an option of qwen2_moe"):
        preset("tiny", architecture="qwen2", qkv_bias_off=True).validate()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_hf_defaults_of_absent_keys(arch):
    """Absent keys take the transformers class defaults: expert count, top-k, expert width, KV heads, head_dim
    (hidden // heads: these classes have no head_dim field), raw top-k probabilities, every layer sparse."""
    d = _base(arch, hidden_size=512, num_attention_heads=16, num_hidden_layers=2)
    for k in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_key_value_heads",
        "shared_expert_intermediate_size",
    ):
        d.pop(k, None)
    cfg = ModelConfig.from_hf(d)
    cls = transformers.Qwen3MoeConfig if arch == "qwen3_moe" else transformers.Qwen2MoeConfig
    hf = cls(**{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        attn = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
    )
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.norm_topk_prob) == (
        hf.num_key_value_heads,
        attn.head_dim,
        hf.norm_topk_prob,
    )
    assert (
        cfg.decoder_sparse_step == hf.decoder_sparse_step and list(cfg.mlp_only_layers) == hf.mlp_only_layers
    )
    if arch == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == hf.shared_expert_intermediate_size
        assert cfg.qkv_bias and not cfg.qkv_bias_off


def test_expert_count_under_transformers_5_name():
    """transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (an attribute alias): read either."""
    d = _base(num_local_experts=8)
    del d["num_experts"]
    assert ModelConfig.from_hf(d) == ModelConfig.from_hf(_base())


@pytest.mark.parametrize(
    "name,total,active",
    [("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704), ("qwen1.5-moe-a2.7b", 14_315_784_192, 2_689_173_504)],
)
def test_moe_presets_are_the_published_shapes(name, total, active):
    """transformers builds the same parameter count from the config.json we write (on the meta device); the
    active count is what one token reads (30.5B / 3.3B and 14.3B / 2.7B as published)."""
    cfg = preset(name)
    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg.to_hf("bfloat16").items() if k not in ("architectures",)}
    )
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert type(hf).__name__ == cfg.to_hf("bfloat16")["architectures"][0]
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params() == total
    assert cfg.num_active_params() == active


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen2-moe", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_sparse_layers_follow_transformers_rule(name):
    cfg = preset(name, num_layers=6)
    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg.to_hf("float32").items() if k not in ("architectures",)}
    )
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(6)] == hf_sparse
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf("float32")))) == cfg
