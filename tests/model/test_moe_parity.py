"""Qwen3-MoE and Qwen2-MoE checkpoints mean the same thing here as in transformers: transformers makes and saves
tiny MoE models with odd options, exactrl loads them and matches their per-token logprobs in float32; what exactrl
saves, transformers loads with the same tensors and the same logprobs; a checkpoint that lacks an expert or holds
one of the wrong shape is refused by name."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from exactrl.model.config import ModelConfig, preset  # noqa: E402
from exactrl.model.hf import load_model, save_model  # noqa: E402
from exactrl.model.moe import SparseMoeBlock  # noqa: E402
from exactrl.model.qwen import MLP, build_model  # noqa: E402
from exactrl.model.tokenizer import byte_tokenizer  # noqa: E402
from exactrl.ops import AttentionBatch  # noqa: E402

_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_experts=6,
    num_experts_per_tok=2,
    initializer_range=0.15,  # logprobs spread over several nats: a wrong detail shows far above 1e-5
)

# (id, architecture, config overrides): the options a Qwen MoE config.json can set, in odd combinations.
_CASES = [
    ("qwen3moe-norm-topk", "qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3moe-raw-k3-untied", "qwen3_moe", {"num_experts_per_tok": 3, "tie_word_embeddings": False}),
    ("qwen3moe-sparse-step2", "qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),
    ("qwen3moe-mlp-only-bias", "qwen3_moe", {"mlp_only_layers": [0, 2], "attention_bias": True, "head_dim": 24}),
    ("qwen2moe-shared", "qwen2_moe", {}),
    ("qwen2moe-norm-step2-mlp-only", "qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                  "mlp_only_layers": [3]}),
    ("qwen2moe-no-qkv-bias-k1-mqa", "qwen2_moe", {"qkv_bias": False, "num_experts_per_tok": 1,
                                                  "num_key_value_heads": 1}),
]  # fmt: skip


def _hf_model(arch: str, **overrides):
    """A transformers MoE model with random weights, biases and norm weights random too (HF initialises them to
    0 and 1, which would hide one we forgot)."""
    kw = {"tie_word_embeddings": True, **_COMMON, **overrides}
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        kw.setdefault("head_dim", 16)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw))
    else:
        kw.setdefault("shared_expert_intermediate_size", 48)
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "shared_expert_gate" in name:
                p.normal_(0, 0.3)  # sigmoid away from 0.5 for some tokens, towards it for others
    return model.float().eval()


def _hf_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def _our_logprobs(model, seqs):
    lens = [len(s) for s in seqs]
    batch = AttentionBatch.packed(lens)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        lp, _ = model.logprobs(model(ids, batch.q_pos, batch), torch.roll(ids, -1))
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[torch.cumsum(torch.tensor(lens), 0) - 1] = False
    return lp[keep]


def _seqs(vocab=300, lengths=(7, 33, 64, 18), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch,overrides", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_transformers_checkpoint_loads_and_matches(tmp_path, arch, overrides):
    hf = _hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    cfg = ours.config
    assert cfg.architecture == arch
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert not all(sparse) or "mlp_only_layers" not in overrides
    seqs = _seqs()
    ref, mine = _hf_logprobs(hf, seqs), _our_logprobs(ours, seqs)
    assert ref.std() > 0.5, "logprobs too flat to tell a wrong detail"
    assert (ref - mine).abs().max().item() <= 1e-5


def test_what_exactrl_saves_transformers_loads(tmp_path):
    """Per-expert hub names on disk, the same tensors in transformers' (fused) modules, the same logprobs; and
    exactrl loads its own checkpoint back to the same config and bits."""
    tok = byte_tokenizer()
    for name in ("tiny-moe", "tiny-qwen2-moe"):
        cfg = preset(name, vocab_size=tok.vocab_size, num_layers=3, max_position_embeddings=256)
        ours = build_model(cfg, seed=4)
        with torch.no_grad():  # the router's init is small: spread it so routing differs between tokens
            for p in ours.parameters():
                if p.shape[0] == cfg.num_experts and p.dim() == 2:
                    p.mul_(8.0)
        out = tmp_path / name
        save_model(ours, out, tokenizer=tok)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert (
            "model.layers.1.mlp.experts.7.down_proj.weight" in names
            and "model.layers.1.mlp.gate.weight" in names
        )
        assert not any(n.endswith(("gate_up", ".down", "gate_up_proj")) for n in names)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
        hf_state = hf.state_dict()
        for i, layer in enumerate(ours.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                experts = f"model.layers.{i}.mlp.experts."
                assert torch.equal(hf_state[experts + "gate_up_proj"], layer.mlp.experts.gate_up)
                assert torch.equal(hf_state[experts + "down_proj"], layer.mlp.experts.down)
            else:
                assert isinstance(layer.mlp, MLP)
        seqs = _seqs(vocab=tok.vocab_size, lengths=(40, 9))
        ref = _hf_logprobs(hf, seqs)
        assert (ref - _our_logprobs(ours, seqs)).abs().max().item() <= 1e-5
        back = load_model(out, dtype=torch.float32)
        assert back.config == ModelConfig(**{**cfg.__dict__, "eos_token_id": tok.eos_token_id})
        assert torch.equal(_our_logprobs(back, seqs), _our_logprobs(ours, seqs))


def test_bad_expert_tensors_are_refused_by_name(tmp_path):
    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    missing = dict(state)
    del missing["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(missing, str(path))
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.2.mlp.experts.5.up_proj.weight'\]"
    ):
        load_model(tmp_path)
    wrong = dict(state)
    wrong["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 31)
    save_file(wrong, str(path))
    with pytest.raises(
        ValueError, match=r"experts.0.down_proj.weight has shape \(64, 31\), the config needs"
    ):
        load_model(tmp_path)
    extra = dict(state)
    extra["model.layers.1.mlp.experts.6.gate_proj.weight"] = torch.zeros(32, 64)  # a 7th expert of 6
    save_file(extra, str(path))
    with pytest.raises(
        ValueError, match=r"unexpected tensors \['model.layers.1.mlp.experts.6.gate_proj.weight'\]"
    ):
        load_model(tmp_path)


def test_state_dict_round_trip_through_hf_names():
    """load_state_dict(state_dict()) restores the stacked experts exactly; a partial expert set is reported."""
    cfg = preset("tiny-qwen2-moe", num_layers=2)
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=1)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    partial = {k: v for k, v in a.state_dict().items() if "experts.3.gate_proj" not in k}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*experts.3.gate_proj.weight"):
        b.load_state_dict(partial)
