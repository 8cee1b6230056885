"""Adapters in PEFT's format: our save loads back bit for bit; `peft` loads what we save onto the transformers
model and gives our logprobs within fp32 tolerance; we load what `peft` saves. Bad adapters are refused by name."""

import json

import pytest
import torch
from lora_helpers import SEQS_HF, lora_model, tiny, trained_looking

from exactrl.model.hf import load_model, save_model
from exactrl.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_parameters,
    adapter_state_dict,
    load_adapter,
    save_adapter,
)
from exactrl.ops import AttentionBatch


def _our_logprobs(model, seqs=SEQS_HF):
    """[sum(len - 1)] fp32 logprobs of every next token, at T = 1."""
    lens = [len(s) for s in seqs]
    batch = AttentionBatch.packed(lens)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        h = model(ids, batch.q_pos, batch)
        lp, _ = model.logprobs(h, torch.roll(ids, -1))
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[torch.cumsum(torch.tensor(lens), 0) - 1] = False
    return lp[keep]


def _hf_logprobs(model, seqs=SEQS_HF):
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logits = model(input_ids=ids).logits[0].float()
            out.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def test_round_trip_is_bitwise_and_in_place(tmp_path):
    model = lora_model(torch.bfloat16, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "o_proj", "up_proj"])
    save_adapter(model, tmp_path / "a", base_model_name_or_path="tiny")
    doc = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert doc["r"] == 4 and doc["lora_alpha"] == 8.0 and doc["peft_type"] == "LORA"
    assert doc["target_modules"] == ["q_proj", "v_proj", "o_proj", "up_proj"]
    sd = adapter_state_dict(model)
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight" in sd
    assert sd["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].shape == (384, 4)
    assert len(sd) == 2 * 4 * 2
    fresh = tiny(torch.bfloat16)
    spec = load_adapter(fresh, tmp_path / "a")
    assert spec.rank == 4 and spec.target_modules == ("q_proj", "v_proj", "o_proj", "up_proj")
    for a, b in zip(adapter_parameters(model), adapter_parameters(fresh), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_our_logprobs(fresh), _our_logprobs(model))
    # Into a model that has adapters: in place, the parameters keep their addresses (optimizer, CUDA graphs).
    other = lora_model(
        torch.bfloat16, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "o_proj", "up_proj"], seed=5
    )
    trained_looking(other, seed=99)
    ptrs = [p.data_ptr() for p in adapter_parameters(other)]
    load_adapter(other, tmp_path / "a")
    assert [p.data_ptr() for p in adapter_parameters(other)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(adapter_parameters(model), adapter_parameters(other)))


def _write_config(d, **changes):
    doc = json.loads((d / ADAPTER_CONFIG).read_text())
    doc.update(changes)
    (d / ADAPTER_CONFIG).write_text(json.dumps(doc))


def test_bad_adapters_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    model = lora_model(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    d = save_adapter(model, tmp_path / "a")
    _write_config(d, use_dora=True)
    with pytest.raises(ValueError, match="use_dora = True is not supported"):
        load_adapter(tiny(), d)
    _write_config(d, use_dora=False, rank_pattern={"q_proj": 8})
    with pytest.raises(ValueError, match="rank_pattern"):
        load_adapter(tiny(), d)
    _write_config(d, rank_pattern={})
    other = lora_model(rank=8, alpha=8.0, targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="rank 4 / scale 2.0 differ"):
        load_adapter(other, d)
    sd = load_file(str(d / ADAPTER_WEIGHTS))
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    sd[key] = torch.zeros(127, 4)
    save_file(sd, str(d / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match=f"{key} has shape \\(127, 4\\), the model needs \\(128, 4\\)"):
        load_adapter(tiny(), d)
    del sd[key], sd[key.replace("lora_B", "lora_A")]
    save_file(sd, str(d / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="missing \\['model.layers.1.self_attn.q_proj'\\]"):
        load_adapter(tiny(), d)
    (d / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        load_adapter(tiny(), d)


def _rename_keys(d, rename) -> None:
    """Rewrite the adapter file in `d` with every key passed through `rename`."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / ADAPTER_WEIGHTS))
    save_file({rename(k): v for k, v in sd.items()}, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def _with_name(name: str):
    """PEFT's in-memory naming: `...lora_A.<adapter name>.weight`."""
    return lambda k: k.replace(".lora_A.weight", f".lora_A.{name}.weight").replace(
        ".lora_B.weight", f".lora_B.{name}.weight"
    )


@pytest.mark.parametrize("layout", ["plain", "default", "named"])
def test_adapter_keys_with_and_without_the_adapter_name_load_the_same(tmp_path, layout):
    """Files that keep the adapter's name in their keys (`lora_A.default.weight`, as PEFT's state dict and some
    PEFT versions and tools write them; or another name) load exactly what the plain layout loads: every A into
    its A and every B into its B, bit for bit, and the model computes the same logprobs."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = lora_model(torch.bfloat16, rank=4, alpha=8.0, targets=targets)
    trained_looking(model, seed=7)  # B != 0 and A, B of different values: a swap or a miss shows
    from safetensors.torch import load_file

    d = save_adapter(model, tmp_path / "a")
    if layout != "plain":
        name = "default" if layout == "default" else "my_task"
        _rename_keys(d, _with_name(name))
        assert all(f".{name}.weight" in k for k in load_file(str(d / ADAPTER_WEIGHTS)))
    fresh = tiny(torch.bfloat16)
    spec = load_adapter(fresh, d)
    assert spec.rank == 4 and spec.target_modules == tuple(targets)
    ours, theirs = adapter_parameters(model), adapter_parameters(fresh)
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert torch.equal(_our_logprobs(fresh), _our_logprobs(model))
    # negative control: the base alone computes other logprobs, so the comparison above can fail
    assert not torch.equal(_our_logprobs(tiny(torch.bfloat16)), _our_logprobs(model))


def test_adapter_keys_of_several_adapters_or_twice_are_refused(tmp_path):
    model = lora_model(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    d = save_adapter(model, tmp_path / "a")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / ADAPTER_WEIGHTS))
    q = [k for k in sd if ".q_proj." in k]
    mixed = {(_with_name("one")(k) if k in q else _with_name("two")(k)): v for k, v in sd.items()}
    save_file(mixed, str(d / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="several adapters \\(one, two\\)"):
        load_adapter(tiny(), d)
    twice = {**sd, _with_name("default")(q[0]): sd[q[0]].clone()}
    save_file(twice, str(d / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="has lora_[AB] twice"):
        load_adapter(tiny(), d)


transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """Our tiny base model saved as an HF checkpoint (fp32), and its directory."""
    d = tmp_path_factory.mktemp("base")
    save_model(tiny(seed=3), d)
    return d


def _hf(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_loads_what_we_save(tmp_path, hf_base, rslora):
    peft = pytest.importorskip("peft")
    base = load_model(hf_base)
    from exactrl.model.lora import LoraSpec, add_lora

    add_lora(base, LoraSpec(rank=4, alpha=16.0, rslora=rslora), seed=1)
    trained_looking(base, std=0.2)
    save_adapter(base, tmp_path / "a")
    hf = peft.PeftModel.from_pretrained(_hf(hf_base), str(tmp_path / "a"))
    ours, theirs = _our_logprobs(base), _hf_logprobs(hf)
    diff = float((ours - theirs).abs().max())
    print(f"peft parity max |diff| = {diff:.3g}")
    assert diff < 1e-4, diff
    # The adapter matters far above that tolerance (negative control: the base model alone is far off).
    assert float((_hf_logprobs(_hf(hf_base)) - ours).abs().max()) > 1e-2


def test_we_load_what_peft_saves(tmp_path, hf_base):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj", "gate_proj"])
    hf = peft.get_peft_model(_hf(hf_base), cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_B" in name:  # PEFT's init leaves B = 0: make the adapter do something
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(str(tmp_path / "p"))
    ours = load_model(hf_base)
    spec = load_adapter(ours, tmp_path / "p")
    assert spec.target_modules == ("q_proj", "k_proj", "gate_proj", "down_proj")
    diff = float((_our_logprobs(ours) - _hf_logprobs(hf.eval())).abs().max())
    print(f"peft parity max |diff| = {diff:.3g}")
    assert diff < 1e-4, diff


def test_merged_export_loads_in_transformers(tmp_path, hf_base):
    """`merged_model` + `save_model`: the HF checkpoint an `export --merge` writes, loadable without peft."""
    from exactrl.model.lora import LoraSpec, add_lora, merged_model

    ours = load_model(hf_base)
    add_lora(ours, LoraSpec(rank=4, alpha=8.0), seed=2)
    trained_looking(ours, std=0.2)
    save_model(merged_model(ours), tmp_path / "m")
    diff = float((_our_logprobs(ours) - _hf_logprobs(_hf(tmp_path / "m"))).abs().max())
    assert diff < 1e-4, diff
    assert float((_our_logprobs(load_model(hf_base)) - _our_logprobs(ours)).abs().max()) > 1e-2
