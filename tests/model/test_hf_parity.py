"""A real HF checkpoint means the same thing here: transformers makes tiny Qwen3/Qwen2 checkpoints, exactrl
loads them and must match HF's per-token logprobs in float32."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from exactrl.model.hf import load_model, save_model  # noqa: E402
from exactrl.model.rope import RopeScaling  # noqa: E402
from exactrl.model.tokenizer import byte_tokenizer  # noqa: E402
from exactrl.ops import AttentionBatch  # noqa: E402

_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    # Larger than HF's 0.02 so the logprobs spread over several nats and a wrong detail shows far above 1e-4.
    initializer_range=0.15,
)


def _hf_model(arch: str, tied: bool = True, **overrides):
    """A transformers model of `arch` ("qwen3", "qwen2", "llama") with random weights, every bias and norm weight
    random too (HF initialises them to 0 and 1, which would hide a bias or a norm we forgot)."""
    kw = {**_COMMON, "tie_word_embeddings": tied, **overrides}
    torch.manual_seed(0)
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.float().eval()


def _hf_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp)
    return torch.cat(out)


def _our_logprobs(model, seqs):
    lens = [len(s) for s in seqs]
    batch = AttentionBatch.packed(lens)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        h = model(ids, batch.q_pos, batch)
    targets = torch.roll(ids, -1)
    lp, _ = model.logprobs(h, targets)
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[torch.cumsum(torch.tensor(lens), 0) - 1] = False  # the last row of each sequence has no target
    return lp[keep]


def _max_diff(hf, ours, lengths=(7, 33, 64, 18), seed=1) -> float:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    return (_hf_logprobs(hf, seqs) - _our_logprobs(ours, seqs)).abs().max().item()


# (id, arch, tied, config overrides, sequence lengths): every option of the three families that exactrl serves.
# The long sequences run past the original context of the scaled RoPE types (64 positions here).
_LONG = (300, 97, 7)
_CASES = [
    ("qwen3-tied-headdim16", "qwen3", True, {}, (7, 33, 64, 18)),
    ("qwen3-untied", "qwen3", False, {}, (7, 33, 64, 18)),
    ("qwen3-attention-bias", "qwen3", True, {"attention_bias": True}, (7, 33, 64, 18)),
    ("qwen3-mqa", "qwen3", True, {"num_key_value_heads": 1}, (7, 33, 64, 18)),
    ("qwen2-tied-qkv-bias", "qwen2", True, {}, (7, 33, 64, 18)),
    ("qwen2-mha-untied", "qwen2", False, {"num_key_value_heads": 4}, (7, 33, 64, 18)),
    ("llama-untied", "llama", False, {}, (7, 33, 64, 18)),
    ("llama-tied-biases", "llama", True, {"attention_bias": True, "mlp_bias": True}, (7, 33, 64, 18)),
    ("llama-headdim24-mqa", "llama", False, {"head_dim": 24, "num_key_value_heads": 1}, (7, 33, 64, 18)),
    ("qwen3-long-default", "qwen3", True, {}, _LONG),
    (
        "qwen3-rope-linear",
        "qwen3",
        True,
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        _LONG,
    ),
    (
        "qwen2-rope-dynamic",
        "qwen2",
        True,
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        _LONG,
    ),
    (
        "qwen3-rope-yarn",
        "qwen3",
        True,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            }
        },
        _LONG,
    ),
    (
        "llama-rope-yarn-explicit",
        "llama",
        False,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.3,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "rope_theta": 10000.0,
            }
        },
        _LONG,
    ),
    (
        "qwen2-rope-yarn-mscale",
        "qwen2",
        False,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            }
        },
        _LONG,
    ),
    (
        "llama-rope-llama3",
        "llama",
        True,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            }
        },
        _LONG,
    ),
]


@pytest.mark.parametrize("arch,tied,overrides,lengths", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_hf_checkpoint_logprobs_match(tmp_path, arch, tied, overrides, lengths):
    hf = _hf_model(arch, tied, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    diff = _max_diff(hf, ours, lengths)
    print(f"max |logprob diff| vs transformers (fp32, CPU): {diff:.2e}")
    assert diff <= 1e-4, diff


def test_rope_scaling_is_not_ignored(tmp_path):
    """Negative control: the YaRN checkpoint read as if it had default RoPE is far off transformers (the bug
    issue 17 found: scaling silently dropped)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    hf = _hf_model("qwen3", True, rope_parameters=rope)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ours.config.__dict__["rope_scaling"] = RopeScaling()  # plant: drop the scaling
    ours._cos_sin = None
    assert _max_diff(hf, ours, _LONG) > 1e-3


def test_legacy_rope_scaling_key(tmp_path):
    """A 4.x config.json (`rope_scaling` with the old `type` key, top-level rope_theta) means the same."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    hf = _hf_model("llama", False, rope_parameters=rope)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    cfg["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path, dtype=torch.float32)
    assert ours.config.rope_scaling.rope_type == "linear" and ours.config.rope_scaling.factor == 2.0
    assert _max_diff(hf, ours, _LONG) <= 1e-4


def test_what_we_save_transformers_loads(tmp_path):
    hf = _hf_model("qwen3", tied=True)
    hf.save_pretrained(tmp_path / "a")
    ours = load_model(tmp_path / "a", dtype=torch.float32)
    save_model(
        ours, tmp_path / "b", tokenizer=byte_tokenizer(), max_shard_bytes=40_000
    )  # forces several shards
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    for (n1, p1), (n2, p2) in zip(hf.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "b")
    assert tok.decode(tok("12+7=19").input_ids) == "12+7=19"


def test_packed_projections_keep_hf_names(tmp_path):
    """q/k/v and gate/up live in one packed weight each, but the state dict holds HF's tensors: the same names and
    values as transformers' model, and a state dict with a part missing or misshapen is refused by name."""
    hf = _hf_model("qwen2", tied=False)  # qwen2: packed biases too
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(ours.named_parameters())
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    broken = dict(mine)
    del broken["model.layers.1.self_attn.v_proj.bias"]
    with pytest.raises(RuntimeError, match=r"model.layers.1.self_attn.v_proj.bias"):
        ours.load_state_dict(broken)
    broken = dict(mine)
    broken["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(RuntimeError, match=r"model.layers.0.mlp.up_proj.weight: shape \(3, 64\)"):
        ours.load_state_dict(broken)
    # A round trip through load_state_dict changes nothing.
    ours.load_state_dict({n: t.clone() for n, t in mine.items()})
    assert all(torch.equal(ours.state_dict()[n], theirs[n]) for n in theirs)


def test_unsupported_architecture_is_refused(tmp_path):
    _hf_model("qwen3", True).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    cfg["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
        load_model(tmp_path)


def test_missing_tensor_is_named_and_nothing_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model("qwen3", False).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.down_proj.weight'\]"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model("qwen3", False).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    state["model.norm.weight"] = torch.ones(63)
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_model(tmp_path)
