"""LoRA keeps the promise: the engine's rollout logprobs equal the trainer's bit for bit with trained-looking
adapters (B != 0), T != 1, n > 1; the fast kernels and a merged engine (W + s B A) are the negative controls."""

import pytest
import torch
from lora_helpers import PROMPTS, count_mismatched, lora_model, rollouts_and_scores, score, tiny

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.model.lora import (
    LoRA,
    LoraSpec,
    ReferenceView,
    adapter_parameters,
    add_lora,
    disable_adapters,
    lora_modules,
    merged_model,
)
from exactrl.ops import get_ops
from exactrl.train.packing import completion_logprobs


def _logprobs(model, seqs, plens):
    return torch.cat(completion_logprobs(model, seqs, plens))


SEQS = [p + [1, 2, 3, 4, 5, 6] for p in PROMPTS]
PLENS = [len(p) for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_mode", [None, "static"])
def test_engine_equals_trainer_with_lora(dtype, decode_mode):
    model = lora_model(dtype)
    flat, scores = rollouts_and_scores(model, decode_mode=decode_mode)
    bad, tot, worst = count_mismatched(flat, scores)
    assert tot >= 6 * 8
    assert bad == 0 and worst == 0.0
    # The adapters matter: the same sequences scored by the base model differ.
    with disable_adapters(model):
        base = score(model, flat)
    assert count_mismatched(flat, base)[0] > tot // 2


def test_fast_ops_negative_control():
    """The same check with PyTorch's default kernels finds differences (fp32 GEMMs of few rows): it can fail."""
    bad, tot, worst = count_mismatched(*rollouts_and_scores(lora_model(exact=False)))
    assert bad > 0 and worst > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_merged_engine_is_not_bitwise_the_trainer(dtype):
    """An engine on merged weights W + s B A samples from other numbers than the trainer's unmerged forward:
    `x (W + s B A)^T` rounds differently from `x W^T + s (x A^T) B^T`. So the engine runs unmerged."""
    model = lora_model(dtype)
    merged = merged_model(model)
    assert not lora_modules(merged) and lora_modules(model)
    flat, _ = rollouts_and_scores(merged)
    scores = score(model, flat)
    bad, tot, worst = count_mismatched(flat, scores)
    assert bad > tot // 4, (bad, tot, worst)
    # ... while it is the same function up to rounding (the merge itself is right).
    assert worst < (1e-4 if dtype == torch.float32 else 0.5)


def test_zero_B_adapter_is_the_base_model_bitwise():
    base = tiny()
    model = tiny()
    add_lora(model, LoraSpec(rank=4, alpha=8))  # PEFT's init: B = 0, so the added term is exactly +0
    assert torch.equal(_logprobs(model, SEQS, PLENS), _logprobs(base, SEQS, PLENS))
    with torch.no_grad():
        lora_modules(model)[0].B(0)[0, 0] = 1e-3  # negative control: one non-zero entry shows
    assert not torch.equal(_logprobs(model, SEQS, PLENS), _logprobs(base, SEQS, PLENS))


def test_disable_adapters_and_reference_view_give_the_base_model():
    base = tiny()
    model = lora_model()
    ref = _logprobs(base, SEQS, PLENS)
    with disable_adapters(model):
        assert torch.equal(_logprobs(model, SEQS, PLENS), ref)
    assert not torch.equal(_logprobs(model, SEQS, PLENS), ref)  # back on after the block
    with pytest.raises(RuntimeError), disable_adapters(model):
        raise RuntimeError("inside")
    assert all(m.enabled for m in lora_modules(model))  # restored on an exception too
    view = ReferenceView(model)
    assert torch.equal(_logprobs(view, SEQS, PLENS), ref)
    assert list(view.parameters()) == []
    with pytest.raises(ValueError, match="needs a model with LoRA"):
        ReferenceView(base)


def test_only_adapters_train_and_state_dict_keeps_hf_names():
    model = tiny()
    names = set(model.state_dict())
    params = add_lora(model, LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in params} == {id(p) for p in adapter_parameters(model)}
    # 2 layers x (q/v stacked A, B_q, B_v; down A, B)
    assert len(params) == 2 * 5
    attn = model.model.layers[0].self_attn.qkv_proj.lora
    assert [p for _, p in attn.targets] == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert attn.lora_A.shape == (2 * 4, 128) and attn.B(2).shape == (64, 4)
    assert model.model.layers[0].mlp.gate_up_proj.lora is None
    assert set(model.state_dict()) == names  # checkpoints and HF export see the base only
    model.load_state_dict(tiny().state_dict(), strict=True)
    bad = dict(model.state_dict())
    bad["model.layers.0.mlp.down_proj.lora.lora_A"] = torch.zeros(4, 384)
    with pytest.raises(RuntimeError, match="load_adapter"):  # never silently dropped, strict or not
        model.load_state_dict(bad, strict=False)
    with pytest.raises(RuntimeError, match="load_adapter"):
        model.load_state_dict(bad)


def test_spec_is_validated():
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0, alpha=8)
    with pytest.raises(ValueError, match="alpha"):
        LoraSpec(rank=4, alpha=0)
    with pytest.raises(ValueError, match="unknown: \\['qkv'\\]"):
        LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "qkv"))
    with pytest.raises(ValueError, match="pissa"):
        LoraSpec(rank=4, alpha=8, init="pissa")
    assert LoraSpec(rank=16, alpha=32).scale == 2.0
    assert LoraSpec(rank=16, alpha=32, rslora=True).scale == 8.0
    model = tiny()
    add_lora(model, LoraSpec(rank=2, alpha=2))
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model, LoraSpec(rank=2, alpha=2))


@pytest.mark.parametrize("exact", [True, False])
def test_lora_projection_rows_are_batch_invariant(exact):
    """The adapter's GEMMs (N = r, K = r) keep a row's bits whatever the number of rows in the call on the exact
    CPU backend; the default kernels do not (negative control: fp32 GEMMs of fewer than 8 rows)."""
    ops = get_ops("cpu", exact)
    model = lora_model(exact=exact, rank=8)
    proj = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(proj.lora, LoRA)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = torch.cat(proj(ops, x), dim=-1)
        bad = [
            m
            for m in (1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255)
            if not torch.equal(torch.cat(proj(ops, x[:m]), -1), full[:m])
        ]
    assert (bad == []) == exact, bad


def test_engine_sees_adapter_updates_in_place():
    """Adapters change in place (as MasterAdamW writes them): the engine, sharing the module, samples from the new
    adapter and still matches the trainer; parameter addresses (what CUDA graphs captured) stay the same."""
    model = lora_model()
    eng = RolloutEngine(
        model,
        EngineConfig(
            num_kv_blocks=64,
            prefill_chunk_size=16,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            max_model_len=64,
        ),
    )
    ptrs = [p.data_ptr() for p in model.parameters()]
    flat0, _ = rollouts_and_scores(model, engine=eng)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.mul_(-3.0)
    flat1, scores1 = rollouts_and_scores(model, engine=eng)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert [c for _, c, _ in flat0] != [c for _, c, _ in flat1]
    assert count_mismatched(flat1, scores1)[0] == 0
