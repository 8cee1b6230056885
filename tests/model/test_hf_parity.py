"""A real HF checkpoint means the same thing here: transformers makes tiny Qwen3/Qwen2 checkpoints, exactrl
loads them and must match HF's per-token logprobs in float32."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from exactrl.model.hf import load_model, save_model  # noqa: E402
from exactrl.model.tokenizer import byte_tokenizer  # noqa: E402
from exactrl.ops import AttentionBatch  # noqa: E402


def _hf_model(arch: str, tied: bool):
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF inits biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
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


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3", False), ("qwen2", True)])
def test_hf_checkpoint_logprobs_match(tmp_path, arch, tied):
    hf = _hf_model(arch, tied)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 33, 64, 1 + 17)]
    diff = (_hf_logprobs(hf, seqs) - _our_logprobs(ours, seqs)).abs().max().item()
    assert diff <= 1e-4, diff


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
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
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
