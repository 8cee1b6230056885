"""config.json keys: every option exactrl does not implement is refused with an error naming the key and its
value; the HF defaults of absent keys are transformers' own; presets and saved Llama checkpoints round-trip."""

import json

import pytest
import torch

from exactrl.model.config import PRESETS, ModelConfig, preset

transformers = pytest.importorskip("transformers")


def _base(arch: str = "qwen3", **extra) -> dict:
    names = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
    d = {
        "architectures": [names[arch]],
        "model_type": arch,
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    d.update(extra)
    return d


@pytest.mark.parametrize(
    "arch,extra,message",
    [
        ("qwen3", {"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
        ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        (
            "qwen2",
            {"quantization_config": {"quant_method": "gptq"}},
            "quantization_config=.*gptq.*not supported",
        ),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        (
            "qwen2",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types=.*sliding_attention",
        ),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
            "rope_type 'longrope' is not supported: it switches frequency sets",
        ),
        (
            "llama",
            {"rope_scaling": {"rope_type": "ntk-magic", "factor": 2.0}},
            "unknown rope_type 'ntk-magic'",
        ),
        (
            "qwen2",
            {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
            "unknown rope_type 'mrope'",
        ),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1]}},
            r"keys \['mrope_section'\] are not understood for rope_type 'yarn'",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            r"rope_type 'llama3' needs \['low_freq_factor', 'high_freq_factor'\]",
        ),
        ("qwen3", {"rope_parameters": {"rope_type": "linear"}}, r"rope_type 'linear' needs \['factor'\]"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
            "partial_rotary_factor is not supported",
        ),
        ("qwen3", {"num_key_value_heads": 3}, "num_heads 4 must be a multiple of num_kv_heads 3"),
        ("llama", {"architectures": ["MistralForCausalLM"]}, "unsupported architecture.*MistralForCausalLM"),
    ],
)
def test_unsupported_keys_are_refused_by_name(arch, extra, message):
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_hf(_base(arch, **extra), where="ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ")


def test_hf_defaults_of_absent_keys():
    """Absent keys take transformers' class defaults: Qwen3's head_dim 128 (not hidden/heads), Qwen's 32 KV heads,
    Llama's KV heads = heads and its 2048 positions, rope_theta 10000, untied embeddings."""
    q3 = _base("qwen3", num_attention_heads=32, hidden_size=512)
    del q3["num_key_value_heads"], q3["max_position_embeddings"]
    cfg = ModelConfig.from_hf(q3)
    hf = transformers.Qwen3Config(**{k: v for k, v in q3.items() if k not in ("architectures",)})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings) == (
        hf.head_dim,
        hf.num_key_value_heads,
        hf.max_position_embeddings,
    )
    ll = _base("llama")
    del ll["num_key_value_heads"], ll["max_position_embeddings"]
    cfg = ModelConfig.from_hf(ll)
    hf = transformers.LlamaConfig(**{k: v for k, v in ll.items() if k not in ("architectures",)})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings) == (16, 4, 2048)
    assert (hf.head_dim, hf.num_key_value_heads, hf.max_position_embeddings) == (16, 4, 2048)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert cfg.tie_word_embeddings is False and cfg.rope_scaling.rope_type == "default"


def test_keys_transformers_ignores_are_ignored():
    """Keys these transformers classes do not read (e.g. Qwen2's attention_bias, generation settings, metadata)
    change nothing, here as there."""
    plain = ModelConfig.from_hf(_base("qwen2"))
    noisy = ModelConfig.from_hf(
        _base(
            "qwen2",
            attention_bias=True,
            mlp_bias=True,
            use_cache=False,
            initializer_range=0.5,
            max_window_layers=3,
            transformers_version="4.51.0",
            temperature=0.7,
            pad_token_id=0,
        )
    )
    assert plain == noisy


def test_top_level_original_max_position_embeddings_wins():
    """transformers gives a top-level original_max_position_embeddings priority over the rope dict's (Phi-3's
    convention) and falls back to max_position_embeddings."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_hf(_base("qwen3", rope_parameters=rope, original_max_position_embeddings=128))
    assert cfg.rope_scaling.original_max_position_embeddings == 128
    cfg = ModelConfig.from_hf(_base("qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    assert cfg.rope_scaling.original_max_position_embeddings == 512


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3.2-3b", "llama3.1-8b"])
def test_llama_presets_are_the_published_shapes(name):
    """transformers builds the same parameter count from the config we would write (on the meta device)."""
    cfg = preset(name)
    hf_cfg = transformers.LlamaConfig(
        **{k: v for k, v in cfg.to_hf("bfloat16").items() if k != "architectures"}
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()  # a tied head is counted once
    expected = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248}
    assert cfg.num_params() == expected[name]
    assert hf.model.rotary_emb.rope_type == "llama3"


def test_llama_checkpoint_round_trip(tmp_path):
    """What exactrl saves for a Llama (tiny-llama preset: llama3 RoPE, untied head) transformers loads with the
    same tensors and the same logprobs, and exactrl loads back to the same config."""
    from exactrl.model.hf import load_model, save_model
    from exactrl.model.qwen import build_model
    from exactrl.model.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    cfg = preset("tiny-llama", vocab_size=tok.vocab_size, num_layers=2, max_position_embeddings=512)
    ours = build_model(cfg, seed=3)
    save_model(ours, tmp_path, tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.rope_parameters["rope_type"] == "llama3"
    mine = ours.state_dict()
    assert sorted(mine) == sorted(hf.state_dict())
    assert all(torch.equal(mine[n], t) for n, t in hf.state_dict().items())
    back = load_model(tmp_path, dtype=torch.float32)
    assert back.config == ModelConfig(**{**cfg.__dict__, "eos_token_id": tok.eos_token_id})
    ids = torch.randint(0, tok.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    from exactrl.ops import AttentionBatch

    batch = AttentionBatch.packed([300])
    with torch.no_grad():
        lp, _ = back.logprobs(back(ids[0], batch.q_pos, batch), torch.roll(ids[0], -1))
    assert (lp[:-1] - ref).abs().max().item() <= 1e-4


def test_every_preset_validates_and_writes_a_config_transformers_reads():
    for name, cfg in PRESETS.items():
        cfg.validate()
        d = cfg.to_hf("bfloat16")
        assert ModelConfig.from_hf(json.loads(json.dumps(d))) == cfg, name
