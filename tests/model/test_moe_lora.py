"""LoRA on a mixture-of-experts model: adapters on the attention projections keep the engine's logprobs bitwise
the trainer's; the MLP targets, which would leave the routed experts unadapted, are refused by name."""

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.model.lora import LoraSpec, add_lora, disable_adapters, lora_modules
from exactrl.train.packing import completion_logprobs

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = [[5, 17, 3, 99, 42], [7] * 19, [11, 12, 13, 200, 201, 202, 7, 8, 9, 30, 31, 32, 33, 1, 2, 3]]


def _lora_moe(name: str, exact: bool = True):
    model = build_model(preset(name, num_layers=2), exact=exact, seed=0)
    add_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=ATTENTION), seed=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # trained-looking adapters: B != 0
        for m in lora_modules(model):
            for i, _ in m.targets:
                m.B(i).copy_(torch.randn(m.B(i).shape, generator=g) * 0.05)
    return model


def _mismatches(model) -> tuple[int, int, int]:
    eng = RolloutEngine(model, EngineConfig(num_kv_blocks=64, prefill_chunk_size=8, max_model_len=64))
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=10, seed=1, n=2))
    flat = [(p, s.token_ids, s.rollout_logprobs) for p, o in zip(PROMPTS, outs) for s in o.samples]
    seqs, plens = [p + c for p, c, _ in flat], [len(p) for p, _, _ in flat]
    scores = completion_logprobs(model, seqs, plens, temperature=0.7)
    with disable_adapters(model):
        base = completion_logprobs(model, seqs, plens, temperature=0.7)
    rec = torch.cat([r for _, _, r in flat])
    return int((rec != torch.cat(scores)).sum()), int((rec != torch.cat(base)).sum()), rec.numel()


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen2-moe"])
def test_attention_lora_on_moe_is_exact(name):
    model = _lora_moe(name)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "experts" in n or ".gate." in n)
    bad, base_bad, total = _mismatches(model)
    assert total >= 60 and bad == 0
    assert base_bad > total // 2, "the adapters were meant to change the logprobs"


def test_fast_backend_negative_control():
    bad, _, _ = _mismatches(_lora_moe("tiny-moe", exact=False))
    assert bad > 0


@pytest.mark.parametrize("targets", [("gate_proj",), ("q_proj", "down_proj", "up_proj")])
def test_mlp_targets_are_refused_on_moe_models(targets):
    model = build_model(preset("tiny-qwen2-moe", num_layers=2))
    with pytest.raises(
        ValueError, match=r"LoRA target_modules \[.*'(gate|down)_proj'.*\]: the qwen2_moe model routes"
    ):
        add_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=targets))
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())
